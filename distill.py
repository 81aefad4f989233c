"""The distill program; see `python distill.py --help` and flax_transformer/cli/distill.py.

Installed, the same program is the command `flax-transformer-distill`.
"""

import sys

from flax_transformer.cli.distill import main

if __name__ == '__main__':
  sys.exit(main())

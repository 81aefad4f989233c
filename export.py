"""The export program; see `python export.py --help` and flax_transformer/cli/export.py.

Installed, the same program is the command `flax-transformer-export`.
"""

import sys

from flax_transformer.cli.export import main

if __name__ == '__main__':
  sys.exit(main())

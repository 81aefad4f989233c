"""The decode program; see `python decode.py --help` and flax_transformer/cli/decode.py.

Installed, the same program is the command `flax-transformer-decode`.
"""

import sys

from flax_transformer.cli.decode import main

if __name__ == '__main__':
  sys.exit(main())

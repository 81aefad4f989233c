"""The train program; see `python train.py --help` and flax_transformer/cli/train.py.

Installed, the same program is the command `flax-transformer-train`.
"""

import sys

from flax_transformer.cli.train import main

if __name__ == '__main__':
  sys.exit(main())

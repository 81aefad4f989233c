"""python -m flax_transformer.bench: the flax-transformer-bench command."""

from flax_transformer.bench.command import main

main()

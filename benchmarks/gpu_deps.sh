# Sourced by benchmarks/gpu.sh and gpu_multi30k.sh: the project's dependencies beside jax (train.py
# and decode.py run from this checkout), added if missing, never replacing the jax (and its CUDA
# plugin) installed there. A machine without a network takes them from wheels carried in .whl/
# (bash benchmarks/gpu_wheels.sh makes them).
imports='import flax, optax, orbax.checkpoint, datasets, tokenizers, sacrebleu, sacremoses, tqdm'
if ! python3 -c "$imports" 2>/dev/null; then
  if compgen -G '.whl/*.whl' > /dev/null; then
    python3 -m pip install --quiet --no-index --no-deps --no-compile --target /tmp/flax_transformer_site .whl/*.whl
    export PYTHONPATH=/tmp/flax_transformer_site${PYTHONPATH:+:$PYTHONPATH}
  else
    constraints=$(mktemp)
    python3 -m pip freeze | grep -iE '^(jax|jaxlib|jax[-_]cuda[0-9]+[-_](plugin|pjrt))==' > "$constraints" || true
    python3 -m pip install --quiet -c "$constraints" -e .
    rm -f "$constraints"
  fi
  python3 -c "$imports"
fi

"""Mutation testing by hand-picked rules: does the test suite notice a plausible bug?

Each mutant is one textual change to one library file (an exact snippet, which must occur
exactly once, and its replacement) and the tests that ought to catch it. For each mutant the
harness copies the working tree (tracked and untracked, not ignored, files) to a temporary
directory, applies the change there, runs the listed tests with `python -m pytest -x -q -n 0`
from that copy (tests/conftest.py puts the copy's root first on sys.path) and reports
KILLED (a test failed), SURVIVED (every test passed: the tests miss that bug) or ERROR
(the snippet is gone or ambiguous: the mutant is stale; or pytest could not run).
The checkout itself is never modified.

    python tools/mutate.py --list                    # the mutants and their tests
    python tools/mutate.py --check                   # every snippet still found exactly once?
    python tools/mutate.py --only lowest_remasks_highest --only mean_becomes_sum
    python tools/mutate.py --baseline --only ...     # the tests pass unmutated, first
    python tools/mutate.py                           # all of them (slow: a pytest run each)

Not part of CI; see docs/contributing.md ("Mutation testing").
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclasses.dataclass(frozen=True)
class Mutant:
  name: str
  file: str  # relative to the repository root
  original: str  # an exact snippet, found exactly once in `file`
  replacement: str
  tests: tuple[str, ...]  # pytest arguments: files or node ids


def m(name, file, original, replacement, *tests):
  return Mutant(name, file, original, replacement, tuple(tests))


NN, DEC, TRAIN, DATA = (
  'flax_transformer/nn/',
  'flax_transformer/decode/',
  'flax_transformer/train/',
  'flax_transformer/data/',
)
NAR = DEC + 'non_autoregressive.py'

MUTANTS = [
  # --- masks ---------------------------------------------------------------------------
  m(
    'padding_mask_inverted',
    NN + 'masks.py',
    'return (tokens != pad_id)[:, None, None, :]',
    'return (tokens == pad_id)[:, None, None, :]',
    'tests/test_masks.py',
  ),
  m(
    'causal_mask_strict',
    NN + 'masks.py',
    'return (key_pos <= query_pos)[None, None]',
    'return (key_pos < query_pos)[None, None]',
    'tests/test_masks.py',
  ),
  m(
    'local_mask_radius_off_by_one',
    NN + 'masks.py',
    'return (jnp.abs(query_pos - key_pos) <= radius)[None, None]',
    'return (jnp.abs(query_pos - key_pos) < radius)[None, None]',
    'tests/test_masks.py',
  ),
  m(
    'segment_mask_sees_earlier_sentences',
    NN + 'masks.py',
    'same = q_segments[:, :, None] == k_segments[:, None, :]',
    'same = q_segments[:, :, None] >= k_segments[:, None, :]',
    'tests/test_masks.py',
    'tests/test_packing.py',
  ),
  # Observable only in PAD query rows (segment 0), whose outputs nothing reads: survived
  # tests/test_masks.py when last run; a test of the docstring's "!= 0" would kill it.
  m(
    'segment_mask_sees_padding',
    NN + 'masks.py',
    'return (same & (k_segments[:, None, :] != 0))[:, None]',
    'return same[:, None]',
    'tests/test_masks.py',
  ),
  m(
    'beam_history_sees_future_slots',
    NN + 'masks.py',
    'written = jnp.arange(length) <= position',
    'written = jnp.arange(length) <= position + 1',
    'tests/test_masks.py',
  ),
  # --- attention -----------------------------------------------------------------------
  m(
    'attention_no_scaling',
    NN + 'attention.py',
    'q = q * jnp.asarray(head_dim**-0.5, q.dtype)',
    'q = q',
    'tests/test_attention.py',
  ),
  m(
    'attention_scale_by_d_not_sqrt_d',
    NN + 'attention.py',
    'q = q * jnp.asarray(head_dim**-0.5, q.dtype)',
    'q = q * jnp.asarray(head_dim**-1.0, q.dtype)',
    'tests/test_attention.py',
  ),
  m(
    'attention_mask_ignored',
    NN + 'attention.py',
    'logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)\n  weights = jax.nn.softmax',
    'logits = logits\n  weights = jax.nn.softmax',
    'tests/test_attention.py',
  ),
  m(
    'attention_no_output_projection',
    NN + 'attention.py',
    '    return self.out(out)',
    '    return out',
    'tests/test_attention.py',
    'tests/test_model_reference.py',
  ),
  m(
    'banded_attention_wrong_scale',
    NN + 'attention.py',
    'q_blocks = q_blocks * jnp.asarray(q.shape[-1] ** -0.5, q.dtype)',
    'q_blocks = q_blocks * jnp.asarray(q.shape[-1] ** -1.0, q.dtype)',
    'tests/test_banded_attention.py',
  ),
  m(
    'attention_logits_in_compute_dtype',
    NN + 'attention.py',
    "logits = jnp.einsum(f'BTNH,{key_axes}->BNTS', q, k, preferred_element_type=jnp.float32)",
    "logits = jnp.einsum(f'BTNH,{key_axes}->BNTS', q, k)",
    'tests/test_attention.py',
    'tests/test_model.py::test_bfloat16_compute_keeps_float32_params_and_logits',
  ),
  m(
    'bfloat16_never_used',
    NN + 'backend.py',
    'return jnp.dtype(resolve_dtype(config.dtype))',
    "return jnp.dtype('float32')",
    'tests/test_model.py::test_bfloat16_compute_keeps_float32_params_and_logits',
  ),
  m(
    'auto_is_float32_everywhere',
    NN + 'backend.py',
    "return 'float32' if (backend or jax.default_backend()) == 'cpu' else 'bfloat16'",
    "return 'float32'",
    'tests/test_compute_dtype.py',
  ),
  # --- layers --------------------------------------------------------------------------
  m(
    'pre_ln_normalizes_nothing',
    NN + 'layers.py',
    "return self.norm(x) if self.config.norm_placement == 'pre' else x",
    'return x',
    'tests/test_model_reference.py',
  ),
  m(
    'post_ln_without_norm',
    NN + 'layers.py',
    "return residual if self.config.norm_placement == 'pre' else self.norm(residual)",
    'return residual',
    'tests/test_model_reference.py',
  ),
  m(
    'no_cross_attention_residual',
    NN + 'layers.py',
    '  y, self.cross_attention(h, cross_kv, cross_mask, deterministic), train',
    '  0 * y, self.cross_attention(h, cross_kv, cross_mask, deterministic), train',
    'tests/test_model_reference.py',
  ),
  m(
    'no_final_decoder_norm',
    NN + 'layers.py',
    '      y = self.final_norm(y)',
    '      y = y',
    'tests/test_model_reference.py',
  ),
  m(
    'ffn_without_activation',
    NN + 'layers.py',
    "hidden = activation(dense(c.d_ff, 'wi')(x))  # [..., d_ff]",
    "hidden = dense(c.d_ff, 'wi')(x)  # [..., d_ff]",
    'tests/test_model_reference.py',
  ),
  m(
    'activation_dropout_at_evaluation',
    NN + 'layers.py',
    '      hidden, deterministic=not train\n',
    '      hidden, deterministic=False\n',
    'tests/test_dropout.py',
  ),
  m(
    'positions_sin_cos_swapped',
    NN + 'layers.py',
    'table = np.stack([np.sin(angle), np.cos(angle)], axis=-1)',
    'table = np.stack([np.cos(angle), np.sin(angle)], axis=-1)',
    'tests/test_attention.py',
  ),
  # --- model ---------------------------------------------------------------------------
  m(
    'no_embedding_scale',
    NN + 'model.py',
    'x = x * jnp.asarray(math.sqrt(c.d_model), compute_dtype(c))',
    'x = x',
    'tests/test_model_reference.py',
  ),
  m(
    'no_positional_encoding',
    NN + 'model.py',
    'return self.embedding_dropout(x + encoding.astype(x.dtype), deterministic=not train)',
    'return self.embedding_dropout(x, deterministic=not train)',
    'tests/test_model.py',
    'tests/test_model_reference.py',
  ),
  m(
    'decoder_not_causal',
    NN + 'model.py',
    'self_mask = self._self_attention_mask(tgt_in, True, segments)',
    'self_mask = self._self_attention_mask(tgt_in, False, segments)',
    'tests/test_model.py',
  ),
  m(
    'cross_attention_sees_source_pad',
    NN + 'model.py',
    'return masks.padding_mask(src, self.config.pad_id)\n',
    'return masks.padding_mask(src, -1)\n',
    'tests/test_model.py',
  ),
  m(
    'cached_step_cache_off_by_one',
    NN + 'model.py',
    'self_mask = masks.causal_mask(length, cache.max_len, position)',
    'self_mask = masks.causal_mask(length, cache.max_len, position + 1)',
    'tests/test_model.py',
  ),
  # --- attention kernels ---------------------------------------------------------------
  m(
    'fused_step_sees_one_slot_too_many',
    NN + 'model.py',
    'masks.KeyLengths(jnp.full((batch,), position + 1, jnp.int32))',
    'masks.KeyLengths(jnp.full((batch,), position + 2, jnp.int32))',
    'tests/test_attention_kernels.py',
  ),
  m(
    'key_lengths_lose_the_look_ahead_mask',
    NN + 'masks.py',
    'return cls(lengths=jnp.maximum(lengths, 1), causal=causal)',
    'return cls(lengths=jnp.maximum(lengths, 1), causal=False)',
    'tests/test_attention_kernels.py',
  ),
  m(
    'fused_cross_attention_sees_source_padding',
    NN + 'model.py',
    'return masks.KeyLengths.of_visible(src_mask)',
    'return masks.KeyLengths(jnp.full(src_mask.shape[:1], src_mask.shape[-1], jnp.int32))',
    'tests/test_attention_kernels.py',
  ),
  m(
    'auto_fuses_cached_steps',
    NN + 'model.py',
    "return not cached or self.config.attention_kernel != 'auto'",
    'return True',
    'tests/test_attention_kernels.py',
  ),
  m(
    'auto_takes_cudnn_at_any_head_size',
    NN + 'backend.py',
    'and config.head_dim <= AUTO_CUDNN_MAX_HEAD_DIM',
    'and config.head_dim <= 4096',
    'tests/test_attention_kernels.py',
  ),
  # --- the chunked loss ----------------------------------------------------------------
  m(
    'chunk_padding_scored',
    'flax_transformer/train/losses.py',
    'targets = jnp.pad(targets, (0, padding), constant_values=pad_id)',
    'targets = jnp.pad(targets, (0, padding), constant_values=pad_id + 1)',
    'tests/test_train_step.py',
  ),
  # --- cmlm ----------------------------------------------------------------------------
  m(
    'cmlm_mask_row_unscaled',
    NN + 'cmlm.py',
    'swap = (self.mask_embedding - table.embedding[c.pad_id]) * math.sqrt(c.d_model)',
    'swap = (self.mask_embedding - table.embedding[c.pad_id])',
    'tests/test_model_reference.py',
    'tests/test_cmlm.py',
  ),
  m(
    'cmlm_length_pool_includes_pad',
    NN + 'cmlm.py',
    'weights = src_mask[:, 0, 0, :, None].astype(jnp.float32)',
    'weights = jnp.ones_like(src_mask[:, 0, 0, :, None], jnp.float32)',
    'tests/test_model_reference.py',
    'tests/test_cmlm.py',
  ),
  m(
    'cmlm_length_classes_unclipped',
    NN + 'cmlm.py',
    'return jnp.clip(offset, -max_offset, max_offset) + max_offset',
    'return offset + max_offset',
    'tests/test_cmlm.py',
  ),
  m(
    'cmlm_uniform_copy_rounds_down',
    NN + 'cmlm.py',
    'index = (2 * position * src_lengths + lengths) // (2 * lengths)',
    'index = (position * src_lengths) // lengths',
    'tests/test_cmlm.py',
  ),
  # --- autoregressive decoding ---------------------------------------------------------
  m(
    'length_penalty_base_off',
    DEC + 'search.py',
    'return ((5.0 + length) / 6.0) ** alpha',
    'return ((6.0 + length) / 6.0) ** alpha',
    'tests/test_decoding.py',
  ),
  m(
    'fairseq_penalty_counts_bos',
    DEC + 'search.py',
    'return length**alpha',
    'return (length + 1.0) ** alpha',
    'tests/test_decoding.py',
  ),
  m(
    'greedy_may_emit_pad',
    DEC + 'search.py',
    'return (vocab == pad_id) | (vocab == bos_id)',
    'return vocab == bos_id',
    'tests/test_decoding.py',
  ),
  # Survived tests/test_decoding.py when last run: random logits never tie exactly.
  m(
    'argmax_takes_last_tie',
    DEC + 'search.py',
    'return jnp.min(jnp.where(is_best, jnp.arange(vocab), vocab), axis=-1)',
    'return jnp.max(jnp.where(is_best, jnp.arange(vocab), -1), axis=-1)',
    'tests/test_decoding.py',
  ),
  m(
    'nan_is_not_picked',
    DEC + 'search.py',
    'is_best = (logits == best) | jnp.isnan(logits)',
    'is_best = logits == best',
    'tests/test_decoding.py',
  ),
  # --- mask-predict (non_autoregressive.py) --------------------------------------------
  m(
    'lowest_remasks_highest',
    NAR,
    'keys = jnp.where(in_row, scores, jnp.inf)',
    'keys = jnp.where(in_row, -scores, jnp.inf)',
    'tests/test_mask_predict_rules.py',
  ),
  m(
    'lowest_remasks_first_positions',
    NAR,
    'keys = jnp.where(in_row, scores, jnp.inf)',
    'keys = jnp.where(in_row, jnp.zeros_like(scores), jnp.inf)',
    'tests/test_mask_predict_rules.py',
  ),
  m(
    'lowest_one_too_many',
    NAR,
    'return rank < count[:, None]',
    'return rank <= count[:, None]',
    'tests/test_mask_predict_rules.py',
  ),
  m(
    'mean_becomes_sum',
    NAR,
    'jnp.sum(jnp.where(in_row, last.scores, 0.0), axis=1) / jnp.maximum(lengths, 1)',
    'jnp.sum(jnp.where(in_row, last.scores, 0.0), axis=1) / 1',
    'tests/test_mask_predict_rules.py',
  ),
  m(
    'refinement_keeps_first_pass',
    NAR,
    'tokens=jnp.where(remask, tokens, canvas.tokens).astype(jnp.int32)',
    'tokens=jnp.where(remask & (canvas.tokens == config.pad_id), tokens, canvas.tokens).astype(jnp.int32)',
    'tests/test_mask_predict_rules.py',
  ),
  m(
    'refinement_scores_not_updated',
    NAR,
    'scores=jnp.where(remask, scores, canvas.scores),',
    'scores=jnp.where(remask & (canvas.tokens == config.pad_id), scores, canvas.scores),',
    'tests/test_mask_predict_rules.py',
  ),
  m(
    'refinement_sees_unmasked_canvas',
    NAR,
    'tokens, scores = predict(jnp.where(remask, mask_id(config), canvas.tokens))',
    'tokens, scores = predict(jnp.where(canvas.tokens == config.pad_id, mask_id(config), canvas.tokens))',
    'tests/test_mask_predict_rules.py',
  ),
  m(
    'remask_schedule_off_by_one',
    NAR,
    'count = lengths * (iterations - t) // iterations',
    'count = lengths * (iterations - t + 1) // iterations',
    'tests/test_mask_predict_rules.py',
  ),
  m(
    'cut_keeps_tokens_after_eos',
    NAR,
    'output = jnp.where(position < end[:, None], tokens, config.pad_id)',
    'output = jnp.where(position < lengths[:, None], tokens, config.pad_id)',
    'tests/test_mask_predict_rules.py',
  ),
  # --- scheduled sampling --------------------------------------------------------------
  m(
    'scheduled_sampling_not_shifted',
    TRAIN + 'scheduled_sampling.py',
    'shifted = jnp.concatenate([gold_in[:, :1], predictions[:, :-1]], axis=1)',
    'shifted = predictions',
    'tests/test_scheduled_sampling.py',
  ),
  # Observable only in packed rows, where a sentence starts mid-row (position 0 of an
  # unpacked row keeps gold_in's token anyway): it survives if no test mixes packed rows.
  m(
    'scheduled_sampling_replaces_bos',
    TRAIN + 'scheduled_sampling.py',
    'use = use & (gold_in != pad_id) & (position > 0)',
    'use = use & (gold_in != pad_id)',
    'tests/test_scheduled_sampling.py',
  ),
  m(
    'scheduled_sampling_linear_unclipped',
    TRAIN + 'scheduled_sampling.py',
    'return jnp.clip(k - c.scheduled_sampling_c * i, c.scheduled_sampling_eps, 1.0)',
    'return jnp.clip(k - c.scheduled_sampling_c * i, 0.0, 1.0)',
    'tests/test_scheduled_sampling.py',
  ),
  # --- packing -------------------------------------------------------------------------
  m(
    'packing_positions_do_not_restart',
    DATA + 'assembly.py',
    "arrays[f'{side}_positions'].ravel()[cell] = position",
    "arrays[f'{side}_positions'].ravel()[cell] = cell % length",
    'tests/test_packing.py',
  ),
  m(
    'packing_tgt_in_keeps_eos',
    DATA + 'assembly.py',
    "arrays['tgt_in'].ravel()[cell] = _shifted(ids, flat, position, corpus.bos_id)",
    "arrays['tgt_in'].ravel()[cell] = tokens",
    'tests/test_packing.py',
  ),
  # --- losses and the training step ----------------------------------------------------
  m(
    'smoothing_weights_swapped',
    TRAIN + 'losses.py',
    'return (1.0 - smoothing) * nll + smoothing * uniform, nll',
    'return smoothing * nll + (1.0 - smoothing) * uniform, nll',
    'tests/test_train_step.py',
  ),
  m(
    'loss_counts_pad',
    TRAIN + 'losses.py',
    'weights = (targets != pad_id).astype(jnp.float32)\n  # Correct',
    'weights = jnp.ones_like(targets, jnp.float32)\n  # Correct',
    'tests/test_train_step.py',
  ),
  m(
    'step_counter_frozen',
    TRAIN + 'step.py',
    'new_state = TrainState(step=state.step + 1, params=params, opt_state=opt_state)',
    'new_state = TrainState(step=state.step, params=params, opt_state=opt_state)',
    'tests/test_train_step.py',
  ),
  # Survived tests/test_train_step.py when last run: Adam is blind to the gradient's scale,
  # and no test compares grad_norm (or one SGD update) with a reference.
  m(
    'step_loss_not_normalised',
    TRAIN + 'step.py',
    "return sums['loss_sum'] / jnp.maximum(global_tokens, 1).astype(jnp.float32), sums",
    "return sums['loss_sum'], sums",
    'tests/test_train_step.py',
  ),
  m(
    'cmlm_objective_length_weight_ignored',
    TRAIN + 'cmlm_objective.py',
    "return sums['loss_sum'] / tokens + length_loss_weight * sums['length_loss_sum'] / sentences",
    "return sums['loss_sum'] / tokens + sums['length_loss_sum'] / sentences",
    'tests/test_cmlm.py',
    'tests/test_cmlm_training.py',
  ),
  m(
    'cmlm_inputs_mask_one_too_many',
    TRAIN + 'cmlm_objective.py',
    '  masked = rank < count[:, None]\n',
    '  masked = rank <= count[:, None]\n',
    'tests/test_cmlm.py',
  ),
  # --- signals (signals.py, cli/failures.py) ---------------------------------------------
  m(
    'signal_never_acted_on_between_batches',
    'flax_transformer/decode/translator.py',
    '      signals.check()  # a program',
    '      pass  # a program',
    'tests/test_signals.py',
  ),
  m(
    'signal_after_the_work_forgotten',
    'flax_transformer/cli/failures.py',
    '  if status != 0 or number is None:\n    return status',
    '  if True:\n    return status',
    'tests/test_signals.py',
    'tests/test_faults.py',
  ),
  # --- the literature's preprocessing, tokenized BLEU, best checkpoint and patience ------
  m(
    'preprocessing_lowercase_skipped',
    DATA + 'preprocessing.py',
    '    if self.lowercase:\n      text = text.lower()\n',
    '',
    'tests/test_preprocessing.py',
  ),
  m(
    'target_prepared_in_the_source_language',
    DATA + 'preprocessing.py',
    'self.preprocessing.prepare(_texts(texts), self.tgt_lang))',
    'self.preprocessing.prepare(_texts(texts), self.src_lang))',
    'tests/test_preprocessing.py',
  ),
  m(
    'cache_key_blind_to_preprocessing',
    DATA + 'preprocessing.py',
    "        'preprocessing': dataclasses.asdict(self.preprocessing),\n",
    '',
    'tests/test_preprocessing.py',
  ),
  m(
    'tokenized_bleu_on_raw_references',
    TRAIN + 'evaluation.py',
    '[moses_tokenized(references, lang)])',
    '[list(references)])',
    'tests/test_preprocessing.py',
  ),
  m(
    'peak_lr_ignored',
    TRAIN + 'optimizer.py',
    '    scale = c.peak_lr * (model_config.d_model * c.warmup_steps) ** 0.5',
    '    scale = c.peak_lr',
    'tests/test_preprocessing.py',
  ),
  m(
    'best_replaced_by_an_equal_score',
    TRAIN + 'best.py',
    "    return value < self.value if self.metric == 'loss' else value > self.value",
    "    return value <= self.value if self.metric == 'loss' else value >= self.value",
    'tests/test_best_checkpoint.py',
  ),
  m(
    'patience_counts_one_validation_late',
    TRAIN + 'best.py',
    '    return step // self.cadence - self.best.step // self.cadence',
    '    return step // self.cadence - self.best.step // self.cadence - 1',
    'tests/test_best_checkpoint.py',
  ),
  m(
    'early_stop_not_saved',
    TRAIN + 'loop.py',
    '    if stopping or now.save or early:\n',
    '    if stopping or now.save:\n',
    'tests/test_best_checkpoint.py',
  ),
  m(
    'run_preprocessing_not_loaded_for_decoding',
    'flax_transformer/run/loading.py',
    '    tokenizer = preprocessing.wrap(tokenizer, read_config(workdir)[2])\n',
    '',
    'tests/test_best_checkpoint.py',
  ),
  m(
    'signal_in_an_evaluation_not_saved',
    TRAIN + 'loop.py',
    '      if (stopping or early) and not now.save:\n',
    '      if False:\n',
    'tests/test_signals.py',
  ),
  # --- BPE-dropout -----------------------------------------------------------------------
  m(
    'bpe_dropout_overlapping_merges',
    'flax_transformer/tokenizer/bpe_dropout.py',
    'merge = chosen & ((place - run_start) % 2 == 0)',
    'merge = chosen',
    'tests/test_bpe_dropout.py',
  ),
  m(
    'bpe_dropout_same_draw_every_round',
    'flax_transformer/tokenizer/bpe_dropout.py',
    'kept = (found >= 0) & (draws(keys, round_index, left.shape[1]) >= self.rate)',
    'kept = (found >= 0) & (draws(keys, 0, left.shape[1]) >= self.rate)',
    'tests/test_bpe_dropout.py',
  ),
  m(
    'bpe_dropout_merges_spelling_special_tokens',
    'flax_transformer/tokenizer/subword.py',
    'return BpeDropout.of(self._encoder, rate)',
    'return BpeDropout.of(self._backend, rate)',
    'tests/test_bpe_dropout.py',
  ),
  m(
    'bpe_dropout_planned_below_plain',
    DATA + 'resegmenting.py',
    'drawn = np.clip(np.maximum(*means), plain[pairs], corpus.max_len)',
    'drawn = np.minimum(np.maximum(*means), corpus.max_len)',
    'tests/test_bpe_dropout.py',
  ),
  m(
    'bpe_dropout_key_ignores_the_epoch',
    DATA + 'resegmenting.py',
    'base = mix(mix(np.uint64(self.seed) + np.uint64(1)) ^ np.uint64(epoch))',
    'base = mix(np.uint64(self.seed) + np.uint64(1))',
    'tests/test_bpe_dropout.py',
  ),
  # --- the weight gradient read in place ---------------------------------------------------
  m(
    'dense_weight_gradient_contracts_3d',
    NN + 'matmul.py',
    'if x.dtype == jnp.float32:',
    'if False:',
    'tests/test_matmul.py',
  ),
]


def working_tree_files(root: Path) -> list[str]:
  out = subprocess.run(
    ['git', 'ls-files', '-z', '--cached', '--others', '--exclude-standard'],
    cwd=root,
    capture_output=True,
    check=True,
  ).stdout
  return [name for name in out.decode().split('\0') if name and (root / name).is_file()]


def check(mutant: Mutant, root: Path = ROOT) -> str | None:
  """None when the mutant applies; otherwise why not."""
  path = root / mutant.file
  if not path.is_file():
    return f'{mutant.file} does not exist'
  found = path.read_text().count(mutant.original)
  if found != 1:
    return f'snippet found {found} times in {mutant.file} (stale mutant?)'
  paths = [t.split('::')[0] for t in mutant.tests if t.split('::')[0].endswith('.py')]
  missing = [path for path in paths if not (root / path).is_file()]
  return f'test files missing: {missing}' if missing else None


def run(mutant: Mutant, timeout: float, keep: bool) -> tuple[str, float, str]:
  """(KILLED | SURVIVED | ERROR, seconds, the failing test or the tail of pytest's output)."""
  problem = None if mutant.original == mutant.replacement == '' else check(mutant)
  if problem:
    return 'ERROR', 0.0, problem
  workdir = Path(tempfile.mkdtemp(prefix=f'mutant-{mutant.name}-'))
  try:
    for name in working_tree_files(ROOT):
      target = workdir / name
      target.parent.mkdir(parents=True, exist_ok=True)
      shutil.copy2(ROOT / name, target)
    if mutant.original:
      path = workdir / mutant.file
      path.write_text(path.read_text().replace(mutant.original, mutant.replacement, 1))
    env = {**os.environ, 'PYTHONDONTWRITEBYTECODE': '1'}
    env.pop('PYTHONPATH', None)
    start = time.monotonic()
    try:
      # -n 0: in one process, whatever pyproject's addopts say; under xdist, -x ends the session
      # as interrupted (status 2), which would read as an error here, not a kill.
      proc = subprocess.run(
        [
          sys.executable,
          '-m',
          'pytest',
          '-x',
          '-q',
          '-n',
          '0',
          '-p',
          'no:cacheprovider',
          *mutant.tests,
        ],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
      )
    except subprocess.TimeoutExpired:
      return 'ERROR', time.monotonic() - start, f'timed out after {timeout:.0f} s'
    seconds = time.monotonic() - start
    tail = '\n'.join((proc.stdout + proc.stderr).strip().splitlines()[-3:])
    if proc.returncode == 0:
      return 'SURVIVED', seconds, tail
    if proc.returncode == 1:
      failed = [line for line in proc.stdout.splitlines() if line.startswith('FAILED')]
      return 'KILLED', seconds, failed[0] if failed else tail
    return 'ERROR', seconds, f'pytest exit code {proc.returncode}: {tail}'
  finally:
    if keep:
      print(f'  kept {workdir}')
    else:
      shutil.rmtree(workdir, ignore_errors=True)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument(
    '--only',
    action='append',
    metavar='NAME',
    help='run this mutant only (repeatable; comma-separated names allowed)',
  )
  parser.add_argument('--list', action='store_true', help='list the mutants and exit')
  parser.add_argument(
    '--check',
    action='store_true',
    help='check that every snippet is found exactly once, run nothing',
  )
  parser.add_argument('--timeout', type=float, default=900, help='seconds per mutant (900)')
  parser.add_argument('--keep', action='store_true', help='keep each mutant directory')
  parser.add_argument(
    '--baseline',
    action='store_true',
    help="first run each selected mutant's tests unmutated: they must pass, or "
    'a kill means nothing (others may be editing the working tree)',
  )
  parser.add_argument(
    '--tests',
    nargs='+',
    metavar='TEST',
    help="run these pytest arguments instead of each mutant's own tests "
    "(each split like a shell word list: 'tests/test_x.py -k name')",
  )
  args = parser.parse_args(argv)

  names = [n for arg in args.only or [] for n in arg.split(',') if n]
  known = {mutant.name: mutant for mutant in MUTANTS}
  assert len(known) == len(MUTANTS), 'mutant names must be unique'
  unknown = [n for n in names if n not in known]
  if unknown:
    parser.error(f'unknown mutant(s): {", ".join(unknown)}; see --list')
  selected = [known[n] for n in names] if names else MUTANTS
  if args.tests:
    tests = tuple(word for arg in args.tests for word in shlex.split(arg))
    selected = [dataclasses.replace(mutant, tests=tests) for mutant in selected]

  if args.list:
    for mutant in selected:
      print(f'{mutant.name:40s} {mutant.file:45s} {" ".join(mutant.tests)}')
    return 0
  if args.check:
    problems = [(mutant.name, check(mutant)) for mutant in selected]
    for name, problem in problems:
      if problem:
        print(f'STALE    {name}: {problem}')
    print(f'{sum(p is None for _, p in problems)} of {len(problems)} mutants apply')
    return int(any(problems[i][1] for i in range(len(problems))))

  if args.baseline:
    for tests in dict.fromkeys(mutant.tests for mutant in selected):
      outcome, seconds, tail = run(Mutant('baseline', '', '', '', tests), args.timeout, args.keep)
      print(
        f'BASELINE {"passes" if outcome == "SURVIVED" else "FAILS"} ({seconds:.0f} s) '
        f'{" ".join(tests)}',
        flush=True,
      )
      if outcome != 'SURVIVED':
        print('         ' + tail.replace('\n', '\n         '), flush=True)
        return 2

  results = []
  for mutant in selected:
    outcome, seconds, tail = run(mutant, args.timeout, args.keep)
    results.append((mutant.name, outcome))
    print(f'{outcome:8s} {mutant.name} ({seconds:.0f} s) {" ".join(mutant.tests)}', flush=True)
    print('         ' + tail.replace('\n', '\n         '), flush=True)
  counts = {o: sum(1 for _, r in results if r == o) for o in ('KILLED', 'SURVIVED', 'ERROR')}
  survivors = [n for n, r in results if r == 'SURVIVED']
  print(
    f'mutation score: {counts["KILLED"]}/{len(results)} killed, {counts["SURVIVED"]} survived'
    f'{" (" + ", ".join(survivors) + ")" if survivors else ""}, {counts["ERROR"]} errors'
  )
  return 0 if counts['SURVIVED'] == counts['ERROR'] == 0 else 1


if __name__ == '__main__':
  sys.exit(main())

"""Language-model training of our Llama 4 architecture (optax AdamW, orbax checkpoints, resumable).

Mixed precision: float32 master weights and optimizer state, bf16 matmuls (on CPUs with AVX512-BF16
they run ~4x faster than f32 in XLA; norms, softmax and the loss stay in f32).
Batches are a pure function of (seed, step), so resuming from the last checkpoint replays exactly the
run that was interrupted. MoE layers add a Switch-style load-balancing loss so experts stay in use.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from tqdm import tqdm

from maverick import data
from maverick import model as model_lib
from maverick.config import Config


class TrainError(ValueError):
  """A training setup that cannot run (bad output dir, corpus too small, ...)."""


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  steps: int = 2000
  batch_size: int = 16
  seq_len: int = 512
  learning_rate: float = 2e-3
  min_learning_rate: float = 1e-4
  warmup_steps: int = 100
  weight_decay: float = 0.1
  clip_norm: float = 1.0
  balance_loss_coef: float = 0.01
  compute_dtype: str = "bfloat16"  # matmuls; master weights and optimizer state stay float32
  seed: int = 0
  checkpoint_every: int = 200
  log_every: int = 10

  def __post_init__(self):
    for f in ("steps", "batch_size", "seq_len", "checkpoint_every", "log_every"):
      if getattr(self, f) < 1:
        raise TrainError(f"{f} must be >= 1, got {getattr(self, f)}")
    if not self.learning_rate > 0:
      raise TrainError(f"learning_rate must be > 0, got {self.learning_rate}")


def lr_schedule(tc: TrainConfig) -> optax.Schedule:
  """Linear warmup, then cosine decay to min_learning_rate at the last step."""
  warmup = min(tc.warmup_steps, tc.steps - 1)
  return optax.warmup_cosine_decay_schedule(0.0, tc.learning_rate, warmup, tc.steps,
                                            end_value=tc.min_learning_rate)


def optimizer(tc: TrainConfig) -> optax.GradientTransformation:
  schedule = lr_schedule(tc)
  no_decay_on_vectors = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
  return optax.chain(
      optax.clip_by_global_norm(tc.clip_norm),
      optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=tc.weight_decay,
                  mask=no_decay_on_vectors))


def lm_loss(model: model_lib.Llama4, batch: jax.Array, balance_coef: float):
  """Next-token cross entropy (nats/token) + balance_coef * mean MoE balance loss."""
  if hasattr(nnx, "capture"):  # newer flax: sow outside capture is deprecated
    out, sown = nnx.capture(model, nnx.Intermediate)(batch[:, :-1])
  else:
    out = model(batch[:, :-1])
    sown = nnx.pop(model, nnx.Intermediate)
  ce = optax.softmax_cross_entropy_with_integer_labels(
      out.logits.astype(jnp.float32), batch[:, 1:]).mean()
  balance = [v for _, v in nnx.to_flat_state(sown)]
  bal = jnp.mean(jnp.stack([jnp.asarray(b).reshape(()) for b in balance])) if balance else 0.0
  return ce + balance_coef * bal, (ce, bal)


LossFn = Callable[[nnx.State, object], tuple[jax.Array, dict]]


def make_train_step(loss_fn: LossFn, tx: optax.GradientTransformation):
  """loss_fn(params, batch) -> (loss, metrics dict); returns a jitted, donating update step."""
  def step(params, opt_state, batch):
    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return params, opt_state, {"loss": loss, **metrics, "grad_norm": optax.tree.norm(grads)}
  return jax.jit(step, donate_argnums=(0, 1))


def check_writable(directory: str):
  try:
    os.makedirs(directory, exist_ok=True)
    probe = os.path.join(directory, f".write-test-{os.getpid()}")
    with open(probe, "w") as f:
      f.write("ok")
    os.remove(probe)
  except OSError as e:
    raise TrainError(f"cannot write to output directory {directory} ({e.strerror}); choose a "
                     "writable --out_dir") from None


@dataclasses.dataclass
class LoopResult:
  params: nnx.State
  step: int  # steps completed
  history: list[dict]  # logged metrics
  resumed_from: int | None
  seconds: float


def train_loop(params: nnx.State, loss_fn: LossFn, batch_fn: Callable[[int], object],
               tc: TrainConfig, workdir: str, *, progress: bool = True,
               stop_after: int | None = None, on_log: Callable[[dict], None] | None = None,
               postfix: Sequence[str] = ("loss",),
               evaluate: Callable[[int, nnx.State], bool] | None = None,
               eval_every: int = 0) -> LoopResult:
  """AdamW steps with orbax checkpoints in `workdir/checkpoints`, resuming from the newest one.

  batch_fn(step) must be a pure function of the step, so a resumed run replays the same batches.
  `stop_after`: return after this many steps of this run without a final checkpoint (as if killed),
  for tests of resuming. `evaluate(step, params) -> stop` runs every `eval_every` steps (early
  stopping on a held-out metric); when it returns True the loop checkpoints and returns.
  """
  check_writable(workdir)
  tx = optimizer(tc)
  opt_state = tx.init(params)
  mngr = ocp.CheckpointManager(
      os.path.abspath(os.path.join(workdir, "checkpoints")),
      options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True))
  start, resumed_from = 0, None
  latest = mngr.latest_step()
  if latest is not None:
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"params": params, "opt": opt_state})
    restored = mngr.restore(latest, args=ocp.args.StandardRestore(target))
    params, opt_state = restored["params"], restored["opt"]
    start = resumed_from = latest
  step_fn = make_train_step(loss_fn, tx)
  save = lambda force=False: mngr.save(
      step, args=ocp.args.StandardSave({"params": params, "opt": opt_state}), force=force)

  history = []
  t0 = time.perf_counter()
  bar = tqdm(total=tc.steps, initial=start, desc="train", unit="step", disable=not progress)
  step = start
  try:
    while step < tc.steps:
      if stop_after is not None and step - start >= stop_after:
        break
      params, opt_state, metrics = step_fn(params, opt_state, jax.device_put(batch_fn(step)))
      step += 1
      bar.update(1)
      if step % tc.log_every == 0 or step == tc.steps:
        m = {k: float(v) for k, v in metrics.items()}
        m["step"] = step
        m["seconds"] = time.perf_counter() - t0
        history.append(m)
        bar.set_postfix({k: f"{m[k]:.3f}" for k in postfix if k in m})
        if on_log:
          on_log(m)
      stop = bool(evaluate and eval_every and step % eval_every == 0 and evaluate(step, params))
      if stop or step % tc.checkpoint_every == 0 or step == tc.steps:
        save(force=stop)
      if stop:
        break
  except KeyboardInterrupt:
    save(force=True)
    raise
  finally:
    mngr.wait_until_finished()
    mngr.close()
    bar.close()
  return LoopResult(params, step, history, resumed_from, time.perf_counter() - t0)


@dataclasses.dataclass
class TrainResult:
  model: model_lib.Llama4
  step: int  # steps completed
  history: list[dict]  # logged metrics
  resumed_from: int | None
  seconds: float


def train(model_cfg: Config, tc: TrainConfig, stream: np.ndarray, workdir: str, *,
          progress: bool = True, stop_after: int | None = None,
          on_log: Callable[[dict], None] | None = None) -> TrainResult:
  """Trains a language model on a token stream (random windows), resumable; see train_loop."""
  if model_cfg.dtype != "float32":
    model_cfg = model_cfg.replace(dtype="float32")
  check_writable(workdir)
  if len(stream) <= tc.seq_len + 1:
    raise TrainError(f"the corpus has {len(stream)} tokens, fewer than one window of "
                     f"{tc.seq_len + 1}; add text or lower --seq_len")
  model = model_lib.init_model(model_cfg, seed=tc.seed)
  model.set_attributes(record_balance_loss=True, raise_if_not_found=False)
  graphdef, params = nnx.split(model, nnx.Param)

  def loss_fn(p, batch):
    p = jax.tree.map(lambda w: w.astype(tc.compute_dtype), p)
    loss, (ce, bal) = lm_loss(nnx.merge(graphdef, p), batch, tc.balance_loss_coef)
    return loss, {"ce": ce, "balance": bal}

  batch_fn = lambda step: data.sample_windows(stream, tc.batch_size, tc.seq_len, tc.seed, step)
  r = train_loop(params, loss_fn, batch_fn, tc, workdir, progress=progress, stop_after=stop_after,
                 on_log=on_log, postfix=("ce", "balance"))
  model = nnx.merge(graphdef, r.params)
  model.set_attributes(record_balance_loss=False, raise_if_not_found=False)
  return TrainResult(model, r.step, r.history, r.resumed_from, r.seconds)

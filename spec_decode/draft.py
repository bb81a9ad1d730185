"""EAGLE-3 draft head: one Llama decoder layer over [norm(embed(token)); norm(hidden)].

Data flow at draft position p (absolute RoPE position p), as in the reference code (not the paper):
  g     = fc([low_p; mid_p; high_p])   on a target-feature step ("extend"), else the previous step's
                                       pre-norm output a_p ("chain step", no fc)
  x     = [embed_norm(embed(token_{p+1})); hidden_norm(g)]        # 2D wide: q/k/v read it directly
  y     = g + attn(x);  a = y + mlp(post_norm(y))                 # the model's own DecoderLayer
                                       (norm_before_residual: hidden_norm(g) + attn(x))
  logits = lm_head(final_norm(a)) over the draft vocabulary; target id = i + d2t[i]
The embedding table is the target's (passed in, never copied). The draft keeps a one-layer KV cache.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from maverick import config as config_lib
from maverick import kernels as kernels_lib
from maverick import kv_cache as kvc
from maverick import sharding_plan
from maverick.config import Config
from maverick.model import DecoderLayer, RMSNorm, token_positions, weight


class DraftConfigError(ValueError):
  """A draft head that does not fit its target, or a malformed draft config."""


class Buffer(nnx.Variable):
  """Non-trainable state saved with the weights (the d2t id map)."""


def default_aux_layers(num_target_layers: int) -> tuple[int, int, int]:
  """(1, N//2 - 1, N - 4): outputs of a low, a middle and a high layer (output-of-layer ids);
  (0, N//2, N - 1) for targets too shallow for those to be distinct. A target of 1 or 2 layers
  (test and compile-check shards) has no 3 distinct layers: (0, 0, N - 1)."""
  n = num_target_layers
  if n < 3:
    return (0, 0, n - 1)
  low, mid, high = 1, n // 2 - 1, n - 4
  if not low < mid < high:  # a shallow target (< 7 layers): first, middle and last instead
    low, mid, high = 0, n // 2, n - 1
  return (low, mid, high)


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
  """An EAGLE-3 draft head's shape: its one decoder layer, the target's width and vocabulary,
  the draft vocabulary and the target layers whose outputs are its features."""

  layer: Config  # the draft decoder layer (num_hidden_layers == 1, global causal attention)
  target_hidden_size: int
  target_vocab_size: int
  draft_vocab_size: int
  # Target layers whose OUTPUTS are the features, kept sorted (low to high): fc reads them
  # concatenated in layer order, as ModelOpt's training hooks collect them and TensorRT-LLM sorts
  # them, whatever order a config lists them in (ModelOpt exports list(set(ids))).
  aux_layer_ids: tuple[int, ...]
  # vLLM / speculators variant: the residual is hidden_norm(g) instead of g (NVIDIA's head: off).
  norm_before_residual: bool = False

  def __post_init__(self):
    if self.layer.num_hidden_layers != 1:
      raise DraftConfigError("the EAGLE-3 draft has exactly one decoder layer")
    if not 1 <= self.draft_vocab_size <= self.target_vocab_size:
      raise DraftConfigError(f"draft_vocab_size {self.draft_vocab_size} must be in "
                             f"[1, target vocab {self.target_vocab_size}]")
    if len(self.aux_layer_ids) != 3:
      raise DraftConfigError(f"EAGLE-3 fuses 3 target layers, got aux_layer_ids "
                             f"{self.aux_layer_ids}")
    object.__setattr__(self, "aux_layer_ids", tuple(sorted(int(i) for i in self.aux_layer_ids)))

  @property
  def hidden_size(self) -> int:
    return self.layer.hidden_size

  def check_target(self, target: Config):
    """Raises DraftConfigError naming the mismatch between this draft and a target model."""
    L = target.num_hidden_layers
    bad = [i for i in self.aux_layer_ids if not 0 <= i < L]
    if bad:
      raise DraftConfigError(f"aux layer ids {list(self.aux_layer_ids)} are outside the target's "
                             f"layers 0..{L - 1} (ids count layer OUTPUTS, 0-based)")
    # fc would weigh one layer's features twice; only a 1- or 2-layer target (a test shard) has
    # no 3 distinct layers to give
    if len(set(self.aux_layer_ids)) < min(3, L):
      raise DraftConfigError(f"aux_layer_ids {list(self.aux_layer_ids)} repeat a layer: EAGLE-3 "
                             f"fuses 3 distinct layers of the target's {L} (output-of-layer ids)")
    if self.target_hidden_size != target.hidden_size:
      raise DraftConfigError(f"draft expects target hidden size {self.target_hidden_size}, the "
                             f"target has {target.hidden_size}")
    if self.hidden_size != target.hidden_size:
      raise DraftConfigError(f"draft hidden size {self.hidden_size} != target hidden size "
                             f"{target.hidden_size}: the draft shares the target's embedding")
    if self.target_vocab_size != target.vocab_size:
      raise DraftConfigError(f"draft maps into a vocabulary of {self.target_vocab_size} ids, the "
                             f"target has {target.vocab_size}")

  @classmethod
  def for_target(cls, target: Config, *, draft_vocab_size: int | None = None,
                 intermediate_size: int | None = None,
                 aux_layer_ids: Sequence[int] | None = None, dtype: str | None = None
                 ) -> "Eagle3Config":
    """A draft shaped like the target's layers (heads, head dim, RoPE base, eps)."""
    layer = Config(
        vocab_size=target.vocab_size, hidden_size=target.hidden_size,
        intermediate_size=target.intermediate_size,
        intermediate_size_mlp=intermediate_size or target.intermediate_size_mlp,
        num_hidden_layers=1, num_attention_heads=target.num_attention_heads,
        num_key_value_heads=target.num_key_value_heads, head_dim=target.head_dim,
        rms_norm_eps=target.rms_norm_eps, moe_layers=(), use_qk_norm=False,
        rope_theta=target.rope_theta, rope_scaling=target.rope_scaling, no_rope_layers=(1,),
        layer_types=(config_lib.FULL,), attn_temperature_tuning=False,
        max_position_embeddings=target.max_position_embeddings, dtype=dtype or target.dtype)
    return cls(layer=layer, target_hidden_size=target.hidden_size,
               target_vocab_size=target.vocab_size,
               draft_vocab_size=draft_vocab_size or target.vocab_size,
               aux_layer_ids=tuple(aux_layer_ids or default_aux_layers(target.num_hidden_layers)))

  def to_dict(self) -> dict[str, Any]:
    return {"layer": self.layer.to_dict(), "target_hidden_size": self.target_hidden_size,
            "target_vocab_size": self.target_vocab_size,
            "draft_vocab_size": self.draft_vocab_size, "aux_layer_ids": list(self.aux_layer_ids),
            "norm_before_residual": self.norm_before_residual}

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> "Eagle3Config":
    d = dict(d)
    d["layer"] = Config.from_dict(d["layer"])
    d["aux_layer_ids"] = tuple(d["aux_layer_ids"])
    return cls(**d)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DraftOutput:
  logits: jax.Array  # [B, (T,) Vd] over the draft vocabulary
  hidden: jax.Array  # [B, (T,) D] pre-norm layer output: the next chain step's hidden input
  cache: kvc.KVCache | None


class Eagle3Draft(nnx.Module):
  """The EAGLE-3 draft head: one of the model's own decoder layers over [norm(embed(token));
  norm(fc(target features))], with its own (optionally reduced-vocabulary) lm_head."""

  def __init__(self, cfg: Eagle3Config, rngs: nnx.Rngs):
    D, Dt = cfg.hidden_size, cfg.target_hidden_size
    lc = cfg.layer
    dt = jnp.dtype(lc.dtype)
    self.config = cfg
    self.fc = weight(rngs, (3 * Dt, D), ("embed_aux", "embed"), dt)
    self.embed_norm = RMSNorm(D, lc.rms_norm_eps, dt, rngs)  # "input_layernorm" in checkpoints
    self.hidden_norm = RMSNorm(D, lc.rms_norm_eps, dt, rngs)
    self.layer = DecoderLayer(lc, 0, rngs, attn_input_dim=2 * D)
    self.final_norm = RMSNorm(D, lc.rms_norm_eps, dt, rngs)
    self.lm_head = weight(rngs, (D, cfg.draft_vocab_size), ("embed", "vocab"), dt)
    self.d2t = Buffer(jnp.zeros((cfg.draft_vocab_size,), jnp.int32))  # offsets: target = i + d2t[i]

  def fuse(self, features_btx):
    """fc over the concatenated target features [B, T, 3*Dt] -> [B, T, D]."""
    return jnp.einsum("btx,xd->btd", features_btx.astype(self.fc.dtype), self.fc[...])

  @kernels_lib.fused_forward()  # what the forward's fused all-reduce sites share
  def __call__(self, tokens_bt, hidden_btd, embed_vd, positions_bt=None, cache=None, *,
               prefill: bool = False, logits_at=None, attention_fn=None,
               tree=None) -> DraftOutput:
    """One draft forward. `hidden_btd` is fc(features) on an extend step or the previous step's
    output on a chain step; `tokens_bt` are the tokens one position AHEAD of the hidden states.
    `tree` (with explicit positions): the new tokens are tree-drafting nodes (model.TreeMask)."""
    T = tokens_bt.shape[1]
    positions_bt, from_zero = token_positions(tokens_bt, positions_bt, cache, prefill, tree)
    g = hidden_btd.astype(self.fc.dtype)
    g_normed = self.hidden_norm(g)
    attn_in = jnp.concatenate([self._embed_normed(tokens_bt, embed_vd, g.dtype), g_normed],
                              axis=-1)
    residual = g_normed if self.config.norm_before_residual else g
    layer_cache = None if cache is None else cache.layer(0)
    lengths = None if cache is None else cache.lengths
    # normed: final_norm(out) when the layer's last site fused it (sharded kernel path)
    out, layer_cache, normed = self.layer(
        residual, positions_bt, layer_cache, lengths, attend_to_cache=not prefill,
        positions_from_zero=from_zero, attn_input=attn_in, attention_fn=attention_fn, tree=tree,
        next_norm=self.final_norm, block_table=None if cache is None else cache.table(0))
    new_cache = None if cache is None else cache.replaced(
        (layer_cache[0],), (layer_cache[1],), (layer_cache[2:],), cache.lengths + T)
    if logits_at is not None:
      at = lambda a: jnp.take_along_axis(a, logits_at[:, None, None].astype(jnp.int32), axis=1)
      out, normed = at(out)[:, 0], None if normed is None else at(normed)[:, 0]
    normed = self.final_norm(out) if normed is None else normed
    logits = jnp.einsum("...d,dv->...v", normed, self.lm_head[...])
    return DraftOutput(logits=logits, hidden=out, cache=new_cache)

  def _embed_normed(self, tokens_bt, embed_vd, dtype):
    """embed_norm(embedding rows); on a sharded kernel path the target's vocab-split table is
    read through the fused all-reduce + norm site, as the target's own lookup is."""
    attn = self.layer.attn
    plan = sharding_plan.plan_of(attn)
    if kernels_lib.fuses_residual_norm(plan, attn.kernels):
      out = kernels_lib.sharded_embed_norm(
          tokens_bt, embed_vd, None, self.embed_norm.weight[...], self.embed_norm.eps,
          attn.kernels, plan, ("vocab", "embed"), dtype)
      if out is not None:
        return out[1]
    return self.embed_norm(jnp.take(embed_vd, tokens_bt, axis=0).astype(dtype))

  def target_ids(self, draft_ids):
    return draft_ids + self.d2t[...][draft_ids]

  def lift_logits(self, logits_vd, target_vocab: int):
    """Draft-vocab logits -> target-vocab logits, -inf outside the draft vocabulary.

    A gather through the inverse id map (one Vd-sized scatter per call, not per row): a per-row
    scatter of B x Vd elements is slow on CPU."""
    Vd = logits_vd.shape[-1]
    source = jnp.full((target_vocab,), -1, jnp.int32).at[self.target_ids(jnp.arange(Vd))].set(
        jnp.arange(Vd, dtype=jnp.int32))
    lifted = jnp.take(logits_vd, jnp.maximum(source, 0), axis=-1)
    return jnp.where(source >= 0, lifted, jnp.asarray(-jnp.inf, logits_vd.dtype))

  def init_cache(self, batch_size: int, capacity: int) -> kvc.KVCache:
    return kvc.KVCache.init(self.config.layer, batch_size, capacity, num_layers=1)


def init_draft(cfg: Eagle3Config, seed: int = 0) -> Eagle3Draft:
  """A randomly initialised draft head of shape `cfg` (what training starts from)."""
  return Eagle3Draft(cfg, nnx.Rngs(params=seed))


def abstract_draft(cfg: Eagle3Config) -> Eagle3Draft:
  return nnx.eval_shape(lambda: Eagle3Draft(cfg, nnx.Rngs(params=0)))

"""Which kernel calls of Maverick and Scout the Pallas kernels do not take, and why.

Runs the resource planners (pallas_kernels/*/plan.py) over the lowering sweep of
maverick/kernel_sweep.py (every projection GEMM, the routed experts' grouped GEMMs, prefill and
decode/verify attention; TP 1/4/8; BF16 and FP8; M tokens; sm90 and sm100) and prints each
unsupported call (op, arch, shape, reason), the unsupported calls grouped by reason, and the
distinct configs the planners chose. No GPU needed; planning only (--lower also lowers one case per
distinct config, as tests/test_kernel_lowering_sweep.py does).

Examples:
  python scripts/kernel_support.py
  python scripts/kernel_support.py --models maverick --archs sm90 --tps 8 --tokens 1,200
  python scripts/kernel_support.py --ops gemm --lower

Run as `maverick-kernel-support` (an installed maverick-jax's console script), as
`python -m maverick.commands.kernel_support`, or from a source checkout as
`python scripts/kernel_support.py`.
"""

import collections

from absl import flags

from maverick import cli

_MODELS = flags.DEFINE_list("models", ["maverick", "scout"], "Model presets.")
_ARCHS = flags.DEFINE_list("archs", ["sm90", "sm100"], "Architectures to plan for.")
_TPS = flags.DEFINE_list("tps", ["1", "4", "8"], "Tensor-parallel degrees.")
_PRECISIONS = flags.DEFINE_list("precisions", ["bf16", "fp8"], "bf16 and/or fp8 (FP8 weights, "
                                "per-token activations, FP8 KV cache).")
_TOKENS = flags.DEFINE_list("tokens", None, "Token counts M (default: kernel_sweep.TOKENS).")
_OPS = flags.DEFINE_list("ops", None, "Ops (gemm, grouped_gemm, prefill_attention, "
                         "decode_attention; default all).")
_LOWER = flags.DEFINE_bool("lower", False, "Also lower one case per distinct planner config.")
_EVERY = flags.DEFINE_bool("every_case", True, "List every unsupported case, not only the "
                           "grouped summary.")


def main(argv):
  del argv
  from maverick import kernel_sweep as ks
  tokens = [int(t) for t in _TOKENS.value] if _TOKENS.value else ks.TOKENS
  cases = list(ks.cases(models=_MODELS.value, archs=_ARCHS.value,
                        tps=[int(t) for t in _TPS.value], precisions=_PRECISIONS.value,
                        tokens=tokens, ops=_OPS.value))
  plans = [(c, ks.plan(c)) for c in cases]
  unsupported = [(c, p) for c, p in plans if not p.supported]
  print(f"{len(cases)} kernel calls planned, {len(unsupported)} unsupported")
  if unsupported and _EVERY.value:
    print("\nunsupported calls (op, arch, model, tp, precision, call, M, shape: reason):")
    for case, plan in unsupported:
      print(f"  {case.describe()}: {plan.why}")
  groups = collections.defaultdict(list)
  for case, plan in unsupported:
    groups[(case.op, case.name, plan.why)].append(case)
  if groups:
    print("\nby reason:")
    for (op, name, why), group in sorted(groups.items()):
      where = sorted({f"{c.model}/tp{c.tp}/{c.precision}/{c.arch}" for c in group})
      ms = sorted({c.m for c in group})
      print(f"  {op} {name}: {why}\n    {len(group)} calls: {', '.join(where)}; M in {ms}")
  configs = collections.defaultdict(list)
  for case, plan in plans:
    if plan.supported:
      configs[ks.config_key(case, plan)].append((case, plan))
  print(f"\n{len(configs)} distinct planner configs:")
  failures = 0
  for key, members in sorted(configs.items(), key=lambda kv: repr(kv[0])):
    case, plan = members[0]
    status = ""
    if _LOWER.value:
      try:
        ks.lower(case)
        status = "  lowers"
      except Exception as e:  # noqa: BLE001 - reported per config
        failures += 1
        status = f"  FAILS TO LOWER: {str(e).splitlines()[0][:200]}"
    tmem = f", {plan.tmem_columns} TMEM columns" if plan.tmem_columns else ""
    print(f"  {case.op} {case.arch} {plan.config} {ks._static(case)}: {len(members)} calls, "
          f"{plan.smem_bytes} B SMEM{tmem}{status}")
  if failures:
    print(f"\n{failures} planner-approved configs fail to lower")
    return 1
  return 0


console_main = cli.console_main(main, __name__)  # the console script `maverick-kernel-support`

if __name__ == "__main__":
  console_main()

"""The command-line programs of maverick-jax, one module each, with the same absl flags however
they are started:

  maverick-generate --prompt "def f(x):"              # console script of an installed package
  python -m maverick.commands.generate --prompt ...   # the module itself
  python scripts/generate.py --prompt ...             # a source checkout, without installing

Console scripts: maverick-generate (generate), maverick-serve (serve), maverick-convert
(convert_hf), maverick-quantize (quantize), maverick-plan-memory (plan_memory),
maverick-benchmark (benchmark), maverick-eval-fp8 (eval_fp8), maverick-eval-ppl (eval_ppl),
maverick-train-eagle3 (train_eagle3), maverick-train-target (train_target),
maverick-gpu-compile-check (gpu_compile_check), maverick-kernel-support (kernel_support).
Each module's `console_main()` is its entry point, `main(argv)` its absl main.

`python -m maverick.commands.<module>` is the module form (as `python -m pip`): a command is a
module of its own because each defines absl flags at import, and two commands' flags (such as
--checkpoint) would clash in one process. Import one command module per process.
"""

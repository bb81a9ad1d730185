"""scripts/gpu_compile_check.py's readers of XLA:GPU output, on small hand-written samples of the
formats it reads (compiled HLO text, thunk sequence dumps, ptxas -v lines). The compiles
themselves need jax's CUDA plugin (`bash tools/setup.sh cuda12`) and run from the script; their
report is in docs/guides/gpu-compile.md."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load():
  from maverick.commands import gpu_compile_check  # argparse: no absl flags defined at import
  return gpu_compile_check


# Shapes as XLA:GPU printed them for a 2-layer Maverick TP8 decode step (cache 8 x 4096 per shard).
HLO = """
%wrapped_transpose_computation (param_0.1010: bf16[8,4096,1,128]) -> bf16[8,1,128,4096] {
  %param_0.1010 = bf16[8,4096,1,128]{3,2,1,0} parameter(0)
  ROOT %transpose.130.1 = bf16[8,1,128,4096]{3,2,1,0} transpose(%param_0.1010), dimensions={0,2,3,1}
}
ENTRY %main {
  %param.16 = bf16[8,4096,1,128]{3,2,1,0} parameter(16)
  %wrapped_transpose = bf16[8,1,128,4096]{3,2,1,0} fusion(%param.16), kind=kInput, calls=%wrapped_transpose_computation
  %input_scatter_fusion.1 = bf16[8,1,128,4096]{3,2,1,0} fusion(%wrapped_transpose, %param.20), kind=kInput, calls=%fused_scatter.1
  %wrapped_transpose.2 = bf16[8,4096,1,128]{3,2,1,0} fusion(%input_scatter_fusion.1), kind=kInput, calls=%wrapped_transpose_computation.2
  %copy.172 = bf16[8,1,128,4096]{3,2,1,0} copy(%broadcast.1570.1)
  %copy.9 = bf16[8,4096,1,64]{3,2,1,0} copy(%param.3)
  %copy.10 = f32[8,4096,1,128]{3,2,1,0} copy(%param.4)
  %dynamic-update-slice.3 = bf16[8,4096,1,128]{3,2,1,0} dynamic-update-slice(%param.16, %x, %i, %j, %k, %l)
}
"""


def test_whole_kv_moves_are_copies_or_transposes_of_a_whole_shard():
  g = _load()
  moves = g.whole_buffer_moves(HLO, (8, 4096, 1, 128), ("bf16",))
  # The transpose into the dot's layout (any order of the dims) and the one back, each once (the
  # fusion, not again the transpose inside its computation). Not: a broadcast materialized once,
  # another shape, another dtype, an in-place update.
  assert moves == ["wrapped_transpose (fusion)", "wrapped_transpose.2 (fusion)"], moves
  assert g.whole_buffer_moves(HLO, (8, 4096, 1, 128), ("f8e4m3fn",)) == []


def test_xla_collectives_are_counted_by_kind():
  g = _load()
  hlo = """
ENTRY %main {
  %all-reduce-start.3 = bf16[8,5120]{1,0} all-reduce-start(%add.1), channel_id=4, replica_groups=[1,8]<=[8], to_apply=%add
  %all-reduce-done.3 = bf16[8,5120]{1,0} all-reduce-done(%all-reduce-start.3)
  %ar.1 = f32[] all-reduce(%c), channel_id=5, to_apply=%add
  ROOT %ag = (f32[8,64]{1,0}, f32[8,512]{1,0}) all-gather-start(%x), dimensions={1}
  %custom-call.7 = (bf16[8,5120]{1,0}, bf16[8,5120]{1,0}) custom-call(%p, %r, %w), custom_call_target="mosaic_gpu_v2"
  %fusion.2 = bf16[8,5120]{1,0} fusion(%all-reduce-done.3), kind=kLoop, calls=%fused_all_reduce_like
}
"""
  found = g.xla_collectives(hlo)
  assert found == {"all-reduce": ["bf16[8,5120]", "f32[]"],
                   "all-gather": ["(f32[8,64], f32[8,512])"], "reduce-scatter": [],
                   "all-to-all": [], "collective-permute": []}, found
  row = {"gpu": "h200", "program": "step", "kernels": "pallas", "xla_temp_GB": 1.0,
         "xla_collectives": {}, "status": "ok"}
  assert "| none |" in g.report([row], "", [])
  row["xla_collectives"] = {"all-reduce": ["bf16[8,5120]"]}
  assert "| 1 all-reduce |" in g.report([row], "", [])


THUNKS_ON = """000: kCommandBuffer [source | sink]
    001: kCopy  [source       | next=003 (2)] kCopy
    003: kWhile [prev=002 (1) | sink        ]
condition:
        004: kCustomKernel [source | sink] loop_compare_fusion
      body:
        005: kCustomKernel [source       | sink        ] loop_add_fusion
006: kCopy [source | sink] kCopy
"""
THUNKS_OFF = """001: kCopy  [source       | next=003 (2)] kCopy
003: kWhile [prev=002 (1) | sink        ]
condition:
    004: kCustomKernel [source | sink] loop_compare_fusion
  body:
    005: kWhile [source | sink]
      006: kHostSend [source | sink]
"""


def test_loop_placement_in_thunk_sequences():
  g = _load()
  assert g.loop_placement(THUNKS_ON) == {"while_in_command_buffer": 1, "while_host_driven": 0,
                                         "host_transfers": 0}
  assert g.loop_placement(THUNKS_OFF) == {"while_in_command_buffer": 0, "while_host_driven": 2,
                                          "host_transfers": 1}


def test_ptxas_summary():
  g = _load()
  text = """ptxas info    : Compiling entry function 'mosaic_gpu_kernel_0' for 'sm_90a'
ptxas info    : Function properties for mosaic_gpu_kernel_0
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 168 registers, used 1 barriers
ptxas info    : Function properties for mosaic_gpu_kernel_1
    8 bytes stack frame, 24 bytes spill stores, 24 bytes spill loads
ptxas info    : Used 255 registers
"""
  assert g.ptxas_summary(text) == {"ptxas_kernels": 2, "max_registers": 255,
                                   "spill_store_bytes": 24}


# As ptxas printed it for the B200 decode-attention kernel before its fix (MOSAIC_GPU_DUMP_PTXAS:
# relocatable code, so the spill is repeated in a warning and setmaxnreg is ignored), then a
# kernel without either.
PTXAS_B200 = """ptxas info    : (C7504) Potential Performance Loss: 'setmaxnreg' ignored to maintain compatibility across compilation units.
ptxas warning : Registers are spilled to local memory in function 'body_mosaic_gpu_kernel', 108 bytes spill stores, 80 bytes spill loads
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'body_mosaic_gpu_kernel' for 'sm_100a'
ptxas info    : Function properties for body_mosaic_gpu_kernel
ptxas         .     56 bytes stack frame, 108 bytes spill stores, 80 bytes spill loads
ptxas info    : Used 168 registers, used 16 barriers, 17 bytes smem
info    : Function properties for 'body_mosaic_gpu_kernel':
info    : used 168 registers, used 16 barriers, 56 stack, 1 bytes smem, 0 bytes lmem
ptxas info    : Compiling entry function 'anonymous_mosaic_gpu_kernel' for 'sm_100a'
ptxas info    : Function properties for anonymous_mosaic_gpu_kernel
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 80 registers, used 16 barriers, 17 bytes smem
info    : Function properties for 'anonymous_mosaic_gpu_kernel':
info    : used 80 registers, used 16 barriers, 0 stack, 1 bytes smem, 0 bytes lmem
"""


def test_ptxas_kernels_count_each_spill_once():
  g = _load()
  assert g.ptxas_kernels(PTXAS_B200) == [
      {"name": "body_mosaic_gpu_kernel", "registers": 168, "spill_store_bytes": 108,
       "setmaxnreg_ignored": True},
      {"name": "anonymous_mosaic_gpu_kernel", "registers": 80, "spill_store_bytes": 0,
       "setmaxnreg_ignored": False}]
  assert g.ptxas_summary(PTXAS_B200) == {"ptxas_kernels": 2, "max_registers": 168,
                                         "spill_store_bytes": 108}


def test_report_lists_spilling_kernel_configs():
  g = _load()
  row = {"gpu": "b200", "program": "decode_attention: 4 kernel configs", "kernels": "pallas",
         "ptxas_kernels": 4, "max_registers": 168, "spill_store_bytes": 108,
         "spilling": ["decode_attention sm100 ... (108 B)"], "status": "ok"}
  text = g.report([row], "", ["--checks", "kernels"])
  assert "| b200 | decode_attention: 4 kernel configs | pallas |" in text
  assert "4 / 168 / 108" in text
  assert "- b200: decode_attention sm100 ... (108 B)" in text


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("jax_plugins") is None
                    or importlib.util.find_spec("jax_plugins.xla_cuda12") is None,
                    reason="needs jax's CUDA plugin (bash tools/setup.sh cuda12)")
def test_every_b200_kernel_config_compiles_without_spills(tmp_path):
  """Where the CUDA build is installed: every distinct kernel config through ptxas for sm_100a,
  0 spill bytes (3 warpgroups get 168 registers a thread: ptxas ignores setmaxnreg in Mosaic's
  relocatable builds). ~1 min of compiling."""
  rows_json = tmp_path / "rows.json"
  subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_compile_check.py"), "--gpus", "b200",
                  "--checks", "kernels", "--rows_json", str(rows_json)], check=True, timeout=1200,
                 env=dict(os.environ, XLA_FLAGS=""))
  rows = json.loads(rows_json.read_text())
  assert len(rows) == 4 and all(r["status"] == "ok" and r["ptxas_kernels"] for r in rows), rows
  assert [r["spilling"] for r in rows] == [[]] * 4


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("jax_plugins") is None
                    or importlib.util.find_spec("jax_plugins.xla_cuda12") is None,
                    reason="needs jax's CUDA plugin (bash tools/setup.sh cuda12)")
def test_kernel_path_decode_and_spec_loops_sit_in_command_buffers(tmp_path):
  """Where the CUDA build is installed: with the kernels (2-layer Maverick TP8 shard), no `while`
  of generate or spec generate is host-driven under the loop flags. B200, 64-token prompts: with
  dynamic-slice fusion on (XLA's default) the fused all-reduce + norm's operand slice became a
  kDynamicSliceFusion and kept 1 (generate) and 3 (spec) loops host-driven. H200, batch 1,
  16-token prompts: the top-p filter's jnp.cumsum (a sequential chlo.scan over the vocab shard)
  kept 3 spec loops host-driven. ~4 min."""
  rows = []
  for gpu, extra in (("b200", ["--prompt_len", "64"]), ("h200", ["--batch", "1"])):
    rows_json = tmp_path / f"{gpu}.json"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_compile_check.py"), "--gpus", gpu,
                    "--checks", "decode", "--layers", "2", "--context", "8192", "--kernels",
                    "pallas", "--programs", "loop,spec", *extra, "--rows_json", str(rows_json)],
                   check=True, timeout=1800, env=dict(os.environ, XLA_FLAGS=""))
    rows += json.loads(rows_json.read_text())
  assert len(rows) == 4 and all(r["status"] == "ok" for r in rows), rows
  assert all(r["while_in_command_buffer"] > 0 and r["while_host_driven"] == 0 for r in rows), rows


def test_flags_are_checked():
  g = _load()
  for bad in (["--gpus", "a100"], ["--checks", "prefill"], ["--kernels", "triton"],
              ["--context", "0"], ["--programs", "prefill"]):
    with pytest.raises(SystemExit):
      g._parse(bad)


def test_thunk_text_takes_the_module_compiled_last(tmp_path):
  """Dumped modules are numbered by id, not in compile order: the newest file is the one."""
  import os
  g = _load()
  old = tmp_path / "module_317837.jit__generate.thunk_sequence_after_thunk_passes.txt"
  new = tmp_path / "module_0001.jit__generate.thunk_sequence_after_thunk_passes.txt"
  other = tmp_path / "module_0002.jit__spec_generate.thunk_sequence_after_thunk_passes.txt"
  for i, (f, text) in enumerate(((old, "old"), (new, "new"), (other, "spec"))):
    f.write_text(text)
    os.utime(f, ns=(10**18 + i * 10**9, 10**18 + i * 10**9))
  assert g.thunk_text(str(tmp_path), "jit__generate") == "new"
  with pytest.raises(RuntimeError, match="no thunk sequence"):
    g.thunk_text(str(tmp_path), "jit__prefill")


def test_each_gpu_compiles_in_a_child_process_of_its_own():
  """Several GPUs: one child per GPU with the same checks (Mosaic's B200 kernels failed ptxas
  after an H200 compile in one process)."""
  gcc = _load()
  argv = ["--gpus", "h200,b200", "--checks", "decode", "--layers=4", "--out", "x.md"]
  assert gcc.child_argv(argv, "b200", "/t/r.json") == [
      "--checks", "decode", "--layers=4", "--out", "x.md", "--gpus", "b200", "--rows_json",
      "/t/r.json"]
  assert gcc.child_argv(["--gpus=h200,b200"], "h200", "r") == ["--gpus", "h200", "--rows_json", "r"]

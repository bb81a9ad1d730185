"""Multi-host: 2 processes x 4 CPU devices (gloo collectives over localhost) restore a converted
checkpoint into one global TP mesh and produce the same greedy tokens as 1 process x 8 devices."""

import json
import pathlib
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

import maverick
from maverick import generation as gen
from maverick import sharding
from maverick.checkpoint import convert_hf_to_orbax
from param_utils import single_device_env

WORKER = pathlib.Path(__file__).parent / "multihost_worker.py"


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


@pytest.mark.parametrize("kw,words", [
    (dict(coordinator_address="localhost:1234"), "pass all of coordinator_address"),
    (dict(num_processes=2, process_id=0), "pass all of coordinator_address"),
    (dict(coordinator_address="localhost:1234", num_processes=2, process_id=2),
     "process_id 2 outside [0, num_processes=2)"),
], ids=["address only", "no address", "process id"])
def test_bad_distributed_arguments_are_refused_before_connecting(kw, words):
  with pytest.raises(sharding.ShardingError) as e:
    sharding.initialize_distributed(**kw)
  assert words in str(e.value)
  assert not jax.distributed.is_initialized()


@pytest.mark.slow
def test_two_processes_match_one_process(hf_fixture_dir, hf_fixture, tmp_path):
  ckpt = convert_hf_to_orbax(str(hf_fixture_dir), str(tmp_path / "ckpt"), dtype="float32",
                             progress=False)
  rng = np.random.default_rng(5)
  prompts = [hf_fixture["inputs"][0].tolist()] + [
      rng.integers(0, 512, n).tolist() for n in (7, 19, 3)]
  (tmp_path / "prompts.json").write_text(json.dumps(prompts))
  port = _free_port()
  env = single_device_env()  # the worker sets its own device count
  procs = [subprocess.Popen(
      [sys.executable, str(WORKER), str(i), "2", str(port), ckpt, str(tmp_path / f"out{i}.json"),
       str(tmp_path / "prompts.json")], env=env, stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT, text=True) for i in range(2)]
  logs = []
  for p in procs:
    try:
      logs.append(p.communicate(timeout=240)[0])
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      raise
  for p, log in zip(procs, logs):
    assert p.returncode == 0, log[-3000:]
  outs = [json.loads((tmp_path / f"out{i}.json").read_text()) for i in range(2)]
  for o in outs:
    assert (o["devices"], o["local_devices"], o["addressable_shards"]) == (8, 4, 4)

  mesh = sharding.make_mesh(data=4, tensor=2)  # this process: 8 devices
  single = gen.generate(maverick.load(ckpt, mesh=mesh, layout="tp").model, prompts,
                        max_new_tokens=10, stop_tokens=[])
  assert outs[0]["tokens"] == outs[1]["tokens"] == single.tokens
  assert single.tokens[0] == hf_fixture["greedy"][:10].tolist()

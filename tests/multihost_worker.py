"""One process of the multi-host test (tests/test_multihost.py): 4 CPU devices of an 8-device mesh.

argv: process_id num_processes port checkpoint_dir out_json prompts_json
"""

import json
import os
import sys

os.environ["XLA_FLAGS"] = ("--xla_force_host_platform_device_count=4 "
                           + os.environ.get("XLA_FLAGS", ""))
os.environ["JAX_PLATFORMS"] = "cpu"

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(process_id, num_processes, port, checkpoint, out_json, prompts_json):
  from maverick import sharding
  sharding.initialize_distributed(f"localhost:{port}", int(num_processes), int(process_id))
  import jax

  import maverick
  from maverick import generation as gen
  assert jax.process_count() == int(num_processes), jax.process_count()
  mesh = sharding.make_mesh(data=4, tensor=2)  # one global mesh over both processes' devices
  model = maverick.load(checkpoint, mesh=mesh, layout="tp").model
  shard = model.layers[0].attn.q[...]
  with open(prompts_json) as f:
    prompts = json.load(f)
  out = gen.generate(model, prompts, max_new_tokens=10, stop_tokens=[])
  with open(out_json, "w") as f:
    json.dump({"tokens": out.tokens, "devices": jax.device_count(),
               "local_devices": jax.local_device_count(),
               "addressable_shards": len(shard.addressable_shards)}, f)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main(*sys.argv[1:])

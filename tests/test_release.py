"""The release: the console commands of pyproject.toml, `maverick.__version__`, and the built
sdist and wheel: `twine check`, the wheel's contents, and the wheel installed (not editable) into a
fresh venv running the main job offline with the embedded model and `--help` of every command.

The fresh venv reuses this environment's installed dependencies (jax, flax, ...) through a .pth
file instead of downloading them: only the wheel itself is installed, with --no-deps --no-index."""

import ast
import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tomllib
import zipfile

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
VERSION = PYPROJECT["project"]["version"]
DIST = "maverick_jax"
PACKAGES = ("maverick", "spec_decode", "pallas_kernels")

# Console script -> its module in maverick/commands/ (and scripts/<module>.py in a checkout).
COMMANDS = {
    "maverick-generate": "generate", "maverick-serve": "serve", "maverick-convert": "convert_hf",
    "maverick-quantize": "quantize", "maverick-plan-memory": "plan_memory",
    "maverick-benchmark": "benchmark", "maverick-eval-fp8": "eval_fp8",
    "maverick-eval-ppl": "eval_ppl", "maverick-train-eagle3": "train_eagle3",
    "maverick-train-target": "train_target", "maverick-gpu-compile-check": "gpu_compile_check",
    "maverick-kernel-support": "kernel_support",
}
# A flag each command's --help must list (the command's own, not a shared one).
HELP_FLAG = {
    "generate": "--prompt", "serve": "--port", "convert_hf": "--hf_dir", "quantize": "--out_dir",
    "plan_memory": "--config", "benchmark": "--ks", "eval_fp8": "--fp8_checkpoint",
    "eval_ppl": "--seq_len", "train_eagle3": "--num_sequences", "train_target": "--vocab_size",
    "gpu_compile_check": "--gpus", "kernel_support": "--archs",
}


def test_console_scripts_are_the_command_modules():
  """[project.scripts] names every command, each `maverick.commands.<module>:console_main`, which
  the module defines and runs as `python -m`; scripts/<module>.py calls the same."""
  assert PYPROJECT["project"]["scripts"] == {
      name: f"maverick.commands.{module}:console_main" for name, module in COMMANDS.items()}
  for module in COMMANDS.values():
    src = (REPO / "maverick" / "commands" / f"{module}.py").read_text()
    tree = ast.parse(src)
    defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    defined |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets
                if isinstance(t, ast.Name)}
    assert {"main", "console_main"} <= defined, module
    assert src.rstrip().endswith('if __name__ == "__main__":\n  console_main()'), module
    thin = (REPO / "scripts" / f"{module}.py").read_text()
    assert f"from maverick.commands import {module}" in thin and f"{module}.console_main()" in thin
  assert set(HELP_FLAG) == set(COMMANDS.values())


def test_python_m_runs_a_command(tmp_path):
  """`python -m maverick.commands.serve --help`: the docstring and the command's flags."""
  r = subprocess.run([sys.executable, "-m", "maverick.commands.serve", "--help"], cwd=tmp_path,
                     capture_output=True, text=True, timeout=60)
  assert "Traceback" not in r.stderr, r.stderr
  assert "OpenAI-compatible server" in r.stdout and "--port" in r.stdout, r.stdout


def test_version_comes_from_the_package_metadata(monkeypatch):
  from importlib import metadata

  import maverick
  assert maverick.__version__ == metadata.version("maverick-jax") == VERSION
  # Not installed (a checkout on sys.path): pyproject.toml's version.

  def not_installed(name):
    raise metadata.PackageNotFoundError(name)

  monkeypatch.setattr(metadata, "version", not_installed)
  assert maverick._version() == VERSION


def _source_copy(dest: pathlib.Path) -> pathlib.Path:
  """The files git tracks (and new ones it does not ignore), as they are in the working tree: no
  build/, egg-info or .venv of the checkout goes into the build."""
  if shutil.which("git") is None or not (REPO / ".git").exists():
    pytest.skip("needs a git checkout of the project")
  files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         cwd=REPO, capture_output=True, check=True).stdout.decode().split("\0")
  for rel in filter(None, files):
    src = REPO / rel
    if src.is_file():  # a tracked file deleted in the working tree is left out
      (dest / rel).parent.mkdir(parents=True, exist_ok=True)
      shutil.copy2(src, dest / rel)
  return dest


def _run(cmd, **kw):
  r = subprocess.run(cmd, capture_output=True, text=True, **kw)
  assert r.returncode == 0, f"{cmd} exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
  return r


def _check_wheel(wheel: pathlib.Path, src: pathlib.Path):
  """The wheel holds the three packages with all their sources and package data (the embedded
  model and draft, tokenizer files), the console scripts and the version; nothing else."""
  names = set(zipfile.ZipFile(wheel).namelist())
  info = f"{DIST}-{VERSION}.dist-info"
  tops = {n.split("/")[0] for n in names}
  assert tops == {*PACKAGES, info}, f"unexpected top-level entries: {tops - {*PACKAGES, info}}"
  wanted = {p.relative_to(src).as_posix() for pkg in PACKAGES for p in (src / pkg).rglob("*")
            if p.is_file() and "__pycache__" not in p.parts}
  assert any(n.startswith("maverick/assets/tiny/params/") for n in wanted)  # the copy has them
  missing = sorted(wanted - names)
  assert not missing, f"{len(missing)} package files not in the wheel, e.g. {missing[:5]}"
  for data in ("maverick/assets/tiny/tokenizer.json", "maverick/assets/tiny/maverick.json",
               "maverick/assets/tiny_eagle3/eagle3.json"):
    assert data in names
  with zipfile.ZipFile(wheel) as z:
    entry_points = z.read(f"{info}/entry_points.txt").decode()
    meta = z.read(f"{info}/METADATA").decode()
  for name, target in PYPROJECT["project"]["scripts"].items():
    assert f"{name} = {target}" in entry_points
  assert f"\nVersion: {VERSION}\n" in meta


def _check_sdist(sdist: pathlib.Path):
  with tarfile.open(sdist) as t:
    names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
  assert {"pyproject.toml", "README.md", "maverick/assets/tiny/tokenizer.json",
          "maverick/commands/generate.py"} <= names


def _fresh_venv(root: pathlib.Path, wheel: pathlib.Path) -> pathlib.Path:
  """A venv with the wheel installed from the file (no index, no dependencies), which finds this
  environment's dependencies after its own site-packages (a .pth line is appended to sys.path; the
  .pth files in that directory, the editable install's finder among them, are not run)."""
  venv = root / "venv"
  _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
  py = venv / "bin" / "python"
  _run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps",
        "--no-index", str(wheel)])
  site = _run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
  deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
  (pathlib.Path(site.stdout.strip()) / "zz_test_env_deps.pth").write_text("\n".join(sorted(deps)))
  return venv


@pytest.mark.slow
def test_built_wheel_installs_and_runs_offline(tmp_path):
  """13 s on 2 idle cores, 22 to 55 s beside other work (the build, 8 tokens with the embedded
  pair, 12 --help): slow tier."""
  src = _source_copy(tmp_path / "src")
  dist = tmp_path / "dist"
  # --no-isolation: the build backend (setuptools, wheel: the test extra) comes from this
  # environment, not from a download. sdist first, then the wheel from the sdist.
  for tool in ("build", "twine", "setuptools", "wheel"):
    assert importlib.util.find_spec(tool), f"no {tool}: bash tools/setup.sh test installs it"
  _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(src)],
       timeout=300)
  (wheel,) = dist.glob(f"{DIST}-{VERSION}-py3-none-any.whl")
  (sdist,) = dist.glob(f"{DIST}-{VERSION}.tar.gz")
  _run([sys.executable, "-m", "twine", "check", "--strict", str(wheel), str(sdist)], timeout=120)
  _check_wheel(wheel, src)
  _check_sdist(sdist)

  venv = _fresh_venv(tmp_path, wheel)
  run_dir = tmp_path / "run"  # outside the repository: no checkout on sys.path
  run_dir.mkdir()
  env = {k: v for k, v in os.environ.items()
         if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "MAVERICK_CACHE_DIR",
                      "JAX_COMPILATION_CACHE_DIR")}
  env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", JAX_PLATFORMS="cpu",
             HF_HUB_OFFLINE="1", MAVERICK_CACHE_DIR=str(tmp_path / "cache"))
  where = _run([str(venv / "bin" / "python"), "-c",
                "import maverick, spec_decode, pallas_kernels, maverick.commands.generate as g\n"
                "for m in (maverick, spec_decode, pallas_kernels, g): print(m.__file__)\n"
                "print(maverick.__version__)"], cwd=run_dir, env=env, timeout=60).stdout.split()
  site = (venv / "lib").resolve()
  for path in where[:-1]:
    assert pathlib.Path(path).resolve().is_relative_to(site), f"{path} is not the installed wheel's"
  assert where[-1] == VERSION

  # The main job: speculative generation with the embedded model and draft, offline.
  r = _run([str(venv / "bin" / "maverick-generate"), "--prompt", "def f(x):",
            "--max_new_tokens", "8"], cwd=run_dir, env=env, timeout=240)
  assert "--- def f(x):" in r.stdout and "new tokens" in r.stdout, r.stdout
  assert "acceptance length" in r.stdout, r.stdout  # the embedded draft ran

  for name, module in COMMANDS.items():
    exe = venv / "bin" / name
    assert exe.is_file(), name
    h = subprocess.run([str(exe), "--help"], cwd=run_dir, env=env, capture_output=True, text=True,
                       timeout=60)
    # absl's --help exits 1 by design (argparse's, gpu_compile_check, 0)
    assert h.returncode in (0, 1) and "Traceback" not in h.stderr, (name, h.stderr)
    assert HELP_FLAG[module] in h.stdout, (name, h.stdout)

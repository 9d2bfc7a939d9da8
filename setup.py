"""kvcli: prefill-time KV-cache compression for GGUF models, from the terminal.

`pip install .` (and `python -m build`, pipx, uv) builds the native library (patched llama.cpp, kvcli.native.build,
cached in ~/.cache/kvcli) into the wheel in its build_py step, with the llama_cpp ctypes bindings beside it: the wheel
is platform-specific and installs without a compiler. CUDA as llama-cpp-python switches it:
CMAKE_ARGS="-DGGML_CUDA=on" (or KVCLI_CUDA=1); other CMAKE_ARGS go to CMake. An editable install (`pip install -e .`,
which ./setup.sh runs) builds the same library and bindings into the checkout's kvcli/native/ (git-ignored), where the
editable kvcli is imported from; `python -m kvcli.native.build` rebuilds there after a change to native/.
"""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Command, Distribution, find_packages, setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent

VERSION = re.search(r'__version__ = "([^"]+)"',
                    Path(__file__).with_name("kvcli").joinpath("__init__.py").read_text()).group(1)


REFERENCE = ["torch>=2.3", "transformers>=4.56", "accelerate"]
RAY = ["ray>=2.9"]
PLOT = ["matplotlib"]   # --plot of bench, eval and calibrate show (94 MB with fonttools, pillow, kiwisolver)
# what the test suite and .ci/run need besides `all` (./setup.sh installs '.[all,test]'); ruff pinned: a new release
# adds rules and fails unchanged code
TEST = ["pytest>=8", "ruff==0.17.5", "openai>=1.0", "hypothesis>=6.100"]


class BuildNative(Command):
    description = "build the patched llama.cpp library (native/) into kvcli/native/lib/"
    user_options = [("cuda", None, "build with -DGGML_CUDA=ON"), ("sanitize", None, "ASan/UBSan build")]

    def initialize_options(self):
        self.cuda = False
        self.sanitize = False

    def finalize_options(self):
        pass

    def run(self):
        from kvcli.native.build import build
        build(cuda=bool(self.cuda), sanitize=bool(self.sanitize))


class BuildPyNative(build_py):
    """build_py, then the native library and its bindings into the build folder's kvcli/native (the wheel's), or for
    an editable install (pip install -e ., ./setup.sh) into the checkout's kvcli/native, which it imports kvcli from,
    as `python -m kvcli.native.build` installs them there (the soname links kept: tests open libggml-base.so)."""

    def run(self):
        super().run()
        editable = getattr(self, "editable_mode", False)
        if editable and os.environ.get("KVCLI_NATIVE_BUILT_APART") == "1":
            # ./setup.sh: `python -m kvcli.native.build` builds into the checkout beside this install (it checks that
            # build itself and fails the set-up if it failed); a wheel never skips its library
            return
        package_dir = None if editable else Path(self.build_lib) / "kvcli" / "native"
        sys.path.insert(0, str(HERE))   # this tree's kvcli.native.build, whatever else is installed
        from kvcli.native.build import BuildError, build, cmake_args_from_env
        cuda, extra = cmake_args_from_env(os.environ)
        try:
            build(cuda=cuda, extra_args=extra, cuda_arch=os.environ.get("KVCLI_CUDA_ARCH"),
                  package_dir=package_dir)
        except BuildError as e:
            sys.exit(f"kvcli: the native build failed: {e}")


class PlatformDistribution(Distribution):
    """The wheel holds compiled libraries: tag it for this platform, not py3-none-any."""

    def has_ext_modules(self):
        return True


def _cmake_ok() -> bool:
    cmake = shutil.which("cmake")
    if not cmake:
        return False
    out = subprocess.run([cmake, "--version"], capture_output=True, text=True).stdout.split()
    try:
        return tuple(int(x) for x in out[2].split(".")[:2]) >= (3, 21)
    except (IndexError, ValueError):
        return False


setup(
    name="kvcli",
    version=VERSION,
    description="Prefill-time KV-cache compression (SnapKV, PyramidKV, WindowKV, DynamicKV, CompressKV, D2O, "
                "SpindleKV, ...) for GGUF models in llama.cpp, with a PyTorch reference engine",
    packages=find_packages(include=["kvcli", "kvcli.*"], exclude=["kvcli.native._vendor", "kvcli.native._vendor.*"]),
    package_data={"kvcli": ["data/*"]},
    python_requires=">=3.10",
    # asked of setuptools' build backend before the build (get_requires_for_build_wheel): CMake's wheel only where
    # the machine has no CMake of its own; pip, which fetches the pinned llama-cpp-python sdist, is in pyproject.toml
    setup_requires=[] if _cmake_ok() else ["cmake>=3.21"],
    # the native engine's needs only: torch and transformers are the reference engine's (kvcli check, --engine
    # reference, kvcli calibrate), the `reference` extra
    # llama-cpp-python is not one: the build copies its ctypes bindings into the wheel (typing-extensions, diskcache and
    # jinja2 are theirs)
    install_requires=["jinja2>=3.1", "gguf", "numpy", "tqdm", "click>=8.1", "typing-extensions>=4.5",
                      "diskcache>=5.6", "starlette>=0.40", "uvicorn>=0.30",   # uvicorn + starlette: kvcli serve
                      "pypdf>=5.0", "python-docx>=1.1"],   # --doc FILE.pdf / FILE.docx (kvcli/doc_formats.py)
    extras_require={"reference": REFERENCE,
                    "ray": RAY,                  # kvcli batch --ray
                    "plot": PLOT,
                    "all": REFERENCE + RAY + PLOT,
                    "test": TEST},
    entry_points={"console_scripts": ["kvcli=kvcli.cli:main"]},
    cmdclass={"build_native": BuildNative, "build_py": BuildPyNative},
    distclass=PlatformDistribution,
)

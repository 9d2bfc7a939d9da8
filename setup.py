"""kvcli: prefill-time KV-cache compression for GGUF models, from the terminal.

The native library (patched llama.cpp) is built by `python -m kvcli.native.build`, which
`./setup.sh` runs; `python setup.py build_native` does the same.
"""
import re
from pathlib import Path

from setuptools import Command, find_packages, setup

VERSION = re.search(r'__version__ = "([^"]+)"',
                    Path(__file__).with_name("kvcli").joinpath("__init__.py").read_text()).group(1)


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


setup(
    name="kvcli",
    version=VERSION,
    description="Prefill-time KV-cache compression (SnapKV, PyramidKV, WindowKV, DynamicKV, CompressKV, D2O, "
                "SpindleKV, ...) for GGUF models in llama.cpp, with a PyTorch reference engine",
    packages=find_packages(include=["kvcli", "kvcli.*"]),
    package_data={"kvcli": ["data/*"]},
    python_requires=">=3.10",
    install_requires=["torch>=2.3", "transformers>=4.56", "jinja2>=3.1", "accelerate", "gguf", "numpy", "tqdm",
                      "click>=8.1", "matplotlib", "llama-cpp-python==0.3.36",
                      "starlette>=0.40", "uvicorn>=0.30",   # uvicorn + starlette: kvcli serve
                      "pypdf>=5.0", "python-docx>=1.1"],   # --doc FILE.pdf / FILE.docx (kvcli/doc_formats.py)
    extras_require={"ray": ["ray>=2.9"]},   # kvcli batch --ray
    entry_points={"console_scripts": ["kvcli=kvcli.cli:main"]},
    cmdclass={"build_native": BuildNative},
)

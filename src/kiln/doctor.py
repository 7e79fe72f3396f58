"""`python -m kiln.doctor` (`make doctor`): explain the Python / torch / CUDA / cuDNN / driver /
ONNX Runtime stack and check the installed packages against requirements.lock.

Exit code 0 when the stack is consistent (no drift from the lock; CUDA either usable or knowingly
absent, e.g. a CUDA build of torch on a machine without an NVIDIA driver), 1 otherwise.

The reasoning lives in small pure functions (`diagnose_cuda`, `find_drift`, ...) that take the
facts as arguments, so tests can feed them machines we do not have; `collect_facts` gathers the
facts of this machine and `main` prints them.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

DEFAULT_LOCK = Path(__file__).resolve().parents[2] / "requirements.lock"

# Minimum Linux x86_64 driver for each CUDA major under minor-version compatibility (CUDA 11+):
# any toolkit of that major runs on at least this driver (NVIDIA's CUDA compatibility guide and
# toolkit release notes). Windows minimums differ slightly (e.g. 527.41 for 12.x).
MIN_DRIVER_FOR_CUDA_MAJOR = {11: "450.80.02", 12: "525.60.13", 13: "580.65.06"}

NVIDIA_SMI_QUERY = ["--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]


# --- CUDA ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Gpu:
    name: str
    driver_version: str
    memory_total: str  # as nvidia-smi prints it, e.g. "81559 MiB"


@dataclass(frozen=True)
class CudaDiagnosis:
    consistent: bool
    verdict: str  # a few words: "CUDA usable", "CPU only", "driver too old", ...
    reason: str  # one sentence a user can act on


def parse_nvidia_smi(output: str) -> list[Gpu]:
    """GPUs from `nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader`.
    Lines that are not such rows (error messages) are ignored."""
    gpus = []
    for line in output.splitlines():
        parts = [part.strip() for part in line.rsplit(",", 2)]  # GPU names may hold commas
        if len(parts) == 3 and re.fullmatch(r"\d+(\.\d+)+", parts[1]):
            gpus.append(Gpu(name=parts[0], driver_version=parts[1], memory_total=parts[2]))
    return gpus


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version))


def min_driver_for_cuda(cuda_version: str) -> str | None:
    """The minimum driver for a CUDA version like "13.0"; None for a major we have no entry for."""
    major = _version_tuple(cuda_version)[0]
    return MIN_DRIVER_FOR_CUDA_MAJOR.get(major)


def _gpus_hidden(cuda_visible_devices: str | None) -> bool:
    # CUDA_VISIBLE_DEVICES="" or "-1" is the usual way to hide every GPU on purpose.
    return cuda_visible_devices is not None and cuda_visible_devices.strip() in ("", "-1")


def diagnose_cuda(
    torch_cuda_version: str | None,
    cuda_available: bool,
    nvidia_smi_output: str | None,
    cuda_visible_devices: str | None = None,
) -> CudaDiagnosis:
    """Why CUDA is or is not usable, and whether that is consistent.

    torch_cuda_version: torch.version.cuda (None for a CPU-only build).
    nvidia_smi_output: the query's output, None when nvidia-smi is not installed (error text when
    it ran and failed). cuda_visible_devices: the environment variable, None when unset.
    """
    gpus = parse_nvidia_smi(nvidia_smi_output or "")
    if cuda_available:
        return CudaDiagnosis(True, "CUDA usable", f"torch (CUDA {torch_cuda_version}) sees the GPU")
    if torch_cuda_version is None:
        if gpus:
            return CudaDiagnosis(
                False,
                "CPU-only torch on a GPU machine",
                f"nvidia-smi lists {len(gpus)} GPU(s) but this torch is a CPU-only build; "
                "install the CUDA build (make install uses the lock's torch wheel)",
            )
        return CudaDiagnosis(True, "CPU only", "torch is a CPU-only build and no NVIDIA GPU found")
    if nvidia_smi_output is None:
        return CudaDiagnosis(
            True,
            "CPU only",
            f"torch is built for CUDA {torch_cuda_version} but this machine has no NVIDIA driver "
            "(nvidia-smi not found)",
        )
    if not gpus:
        first_line = nvidia_smi_output.strip().splitlines()[:1] or ["no output"]
        return CudaDiagnosis(
            False,
            "driver not working",
            f"nvidia-smi is installed but lists no GPU ({first_line[0]}); "
            "is the NVIDIA kernel module loaded, or the GPU passed into this container?",
        )
    driver = gpus[0].driver_version
    required = min_driver_for_cuda(torch_cuda_version)
    if required and _version_tuple(driver) < _version_tuple(required):
        major = _version_tuple(torch_cuda_version)[0]
        return CudaDiagnosis(
            False,
            "driver too old",
            f"driver {driver} is older than {required}, the minimum for CUDA {major}.x "
            f"(torch is built for CUDA {torch_cuda_version}); upgrade the driver or install a "
            "torch built for an older CUDA",
        )
    if _gpus_hidden(cuda_visible_devices):
        return CudaDiagnosis(
            True,
            "CPU only (GPUs hidden)",
            f"CUDA_VISIBLE_DEVICES={cuda_visible_devices!r} hides the {len(gpus)} GPU(s)",
        )
    return CudaDiagnosis(
        False,
        "CUDA unavailable",
        f"driver {driver} and {len(gpus)} GPU(s) are present but torch cannot use them; check "
        "CUDA_VISIBLE_DEVICES, permissions on /dev/nvidia*, and the NVIDIA container runtime",
    )


def format_cudnn_version(version: int | None) -> str:
    """torch.backends.cudnn.version() as text: 92400 -> "9.24.0" (cuDNN 9 encodes
    major*10000 + minor*100 + patch; cuDNN 8 and older major*1000 + minor*100 + patch)."""
    if version is None:
        return "none"
    if version >= 90000:
        major, rest = divmod(version, 10000)
    else:
        major, rest = divmod(version, 1000)
    minor, patch = divmod(rest, 100)
    return f"{major}.{minor}.{patch}"


# --- drift from requirements.lock ------------------------------------------------------------


@dataclass(frozen=True)
class Drift:
    missing: list[str] = field(default_factory=list)  # locked but not installed
    mismatched: list[tuple[str, str, str]] = field(default_factory=list)  # (name, locked, found)

    @property
    def clean(self) -> bool:
        return not self.missing and not self.mismatched


def parse_lock(text: str) -> dict[str, str]:
    """{normalised name: version} for the pinned `name==version` lines of a pip-compile lock.

    Comments, pip options (--hash, -e, ...) and requirements whose environment marker does not
    apply to this interpreter/platform are skipped."""
    pins: dict[str, str] = {}
    for raw_line in text.splitlines():
        line = raw_line.split(" #", 1)[0].strip().rstrip("\\").strip()
        if not line or line.startswith(("#", "-")):
            continue
        try:
            requirement = Requirement(line)
        except InvalidRequirement:
            continue
        if requirement.marker is not None and not requirement.marker.evaluate():
            continue
        exact = [spec.version for spec in requirement.specifier if spec.operator == "=="]
        if exact:
            pins[canonicalize_name(requirement.name)] = exact[0]
    return pins


def installed_versions() -> dict[str, str]:
    """{normalised name: version} of every distribution in this environment."""
    versions = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            versions[canonicalize_name(name)] = dist.version
    return versions


def _same_release(locked: str, installed: str) -> bool:
    # As pip reads "==2.14.1": a local label ("2.14.1+cu130") still satisfies it.
    try:
        return Version(installed).public == Version(locked).public
    except InvalidVersion:
        return installed == locked


def find_drift(locked: Mapping[str, str], installed: Mapping[str, str]) -> Drift:
    """Compare lock pins with installed versions; both keyed by normalised name. Packages that
    are installed but not locked (pip, kiln itself) are not drift."""
    missing, mismatched = [], []
    for name, version in sorted(locked.items()):
        found = installed.get(canonicalize_name(name))
        if found is None:
            missing.append(name)
        elif not _same_release(version, found):
            mismatched.append((name, version, found))
    return Drift(missing=missing, mismatched=mismatched)


# --- facts of this machine -------------------------------------------------------------------


def run_nvidia_smi() -> str | None:
    """The GPU query's output; None when nvidia-smi is not installed; error text when it fails."""
    executable = shutil.which("nvidia-smi")
    if executable is None:
        return None
    try:
        done = subprocess.run(
            [executable, *NVIDIA_SMI_QUERY], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"nvidia-smi failed: {error}"
    return done.stdout if done.returncode == 0 else (done.stdout + done.stderr or "failed")


def torch_facts() -> dict[str, Any]:
    import torch

    facts = {
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "cudnn": format_cudnn_version(torch.backends.cudnn.version()),
    }
    if facts["cuda_available"]:
        facts["torch_gpus"] = [
            torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())
        ]
    return facts


def onnxruntime_facts() -> dict[str, Any]:
    import onnxruntime

    providers = ", ".join(onnxruntime.get_available_providers())
    return {"onnxruntime": onnxruntime.__version__, "ort_providers": providers}


def numpy_facts() -> dict[str, Any]:
    import numpy

    return {"numpy": numpy.__version__}


# Each library's facts, and what stands for them when it cannot be imported.
LIBRARIES = (
    (
        torch_facts,
        lambda e: {"torch": e, "torch_cuda": None, "cuda_available": False, "cudnn": "none"},
    ),
    (onnxruntime_facts, lambda e: {"onnxruntime": e, "ort_providers": "-"}),
    (numpy_facts, lambda e: {"numpy": e}),
)


def collect_facts() -> dict[str, Any]:
    """What the report needs, gathered here; a library that fails to import is reported as such."""
    facts: dict[str, Any] = {
        "python": f"{platform.python_version()} ({sys.executable})",
        "platform": platform.platform(),
        "nvidia_smi": run_nvidia_smi(),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }
    for gather, broken in LIBRARIES:
        try:
            facts.update(gather())
        except Exception as error:  # a broken install is exactly what the doctor is for
            facts.update(broken(f"not importable: {error}"))
    return facts


# --- report ----------------------------------------------------------------------------------


def stack_rows(facts: Mapping[str, Any], cuda: CudaDiagnosis) -> list[tuple[str, str]]:
    """(component, value) rows of the stack table."""
    gpus = parse_nvidia_smi(facts.get("nvidia_smi") or "")
    if facts.get("nvidia_smi") is None:
        driver = "none (nvidia-smi not found)"
    else:
        driver = gpus[0].driver_version if gpus else "nvidia-smi lists no GPU"
    torch_cuda = facts.get("torch_cuda")
    required = min_driver_for_cuda(torch_cuda) if torch_cuda else None
    rows = [
        ("Python", facts["python"]),
        ("Platform", facts["platform"]),
        ("torch", facts["torch"]),
        ("torch CUDA build", torch_cuda or "none (CPU-only build)"),
        ("  needs driver", f">= {required}" if required else "-"),
        ("cuDNN", facts["cudnn"]),
        ("NVIDIA driver", driver),
    ]
    rows += [(f"GPU {i}", f"{gpu.name}, {gpu.memory_total}") for i, gpu in enumerate(gpus)]
    rows += [
        ("torch.cuda.is_available()", str(facts["cuda_available"])),
        ("CUDA", f"{cuda.verdict}: {cuda.reason}"),
        ("ONNX Runtime", facts["onnxruntime"]),
        ("  providers", _providers_note(facts["ort_providers"], facts["cuda_available"])),
        ("numpy", facts["numpy"]),
    ]
    return rows


def _providers_note(providers: str, cuda_available: bool) -> str:
    # onnxruntime-gpu lists its CUDA/TensorRT providers whether or not a GPU exists.
    if "CUDAExecutionProvider" in providers and not cuda_available:
        return f"{providers} (GPU providers are built in but need CUDA; ORT will use CPU here)"
    return providers


def print_report(
    rows: list[tuple[str, str]], drift: Drift, lock_path: Path, num_locked: int, consistent: bool
) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    stack = Table(title="kiln doctor", show_header=True, header_style="bold")
    stack.add_column("component", no_wrap=True)
    stack.add_column("value")
    for component, value in rows:
        stack.add_row(component, value)
    console.print(stack)

    if drift.clean:
        console.print(f"{lock_path}: all {num_locked} locked packages installed at their pins")
    else:
        table = Table(title=f"drift from {lock_path}", header_style="bold")
        for column in ("package", "locked", "installed"):
            table.add_column(column)
        for name in drift.missing:
            table.add_row(name, "", "missing")
        for name, locked, found in drift.mismatched:
            table.add_row(name, locked, found)
        console.print(table)
        console.print("fix: make install (or pip install -r requirements.lock)")
    verdict = "[green]consistent[/green]" if consistent else "[red]inconsistent[/red]"
    console.print(f"stack: {verdict}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kiln.doctor", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--lock", type=Path, default=DEFAULT_LOCK, help="requirements.lock path")
    args = parser.parse_args(argv)
    if not args.lock.is_file():
        parser.error(f"no lock file at {args.lock}; pass --lock PATH")

    facts = collect_facts()
    cuda = diagnose_cuda(
        facts["torch_cuda"],
        facts["cuda_available"],
        facts["nvidia_smi"],
        facts["cuda_visible_devices"],
    )
    locked = parse_lock(args.lock.read_text())
    drift = find_drift(locked, installed_versions())
    consistent = cuda.consistent and drift.clean
    print_report(stack_rows(facts, cuda), drift, args.lock, len(locked), consistent)
    return 0 if consistent else 1


if __name__ == "__main__":
    sys.exit(main())

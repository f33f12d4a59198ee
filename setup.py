"""Build moepeak._C: a pure-C CPython extension, with CUDA C objects linked in
when nvcc is found.

Environment:
  MOEPEAK_CUDA=0   CPU-only build even if nvcc exists.
  MOEPEAK_CUDA=1   a missing nvcc is an error.
  (unset)          CUDA if nvcc is found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin).
  MOEPEAK_CUDA_ARCH  the archs to compile for, as a comma list of nvcc's arch
                   numbers ("80,90", "90a", "100f"): SASS for each, plus PTX of the
                   last. "portable" means PORTABLE_ARCHS even where a GPU is present.
                   Unset: the GPUs present (nvidia-smi's compute_cap: SASS for each,
                   PTX of the newest), else PORTABLE_ARCHS (those this nvcc can
                   target, SASS each + PTX of the newest, which newer GPUs JIT).
                   The list built is moepeak._C.cuda_archs ("sm_80", ...,
                   "compute_120"); moepeak refuses a GPU it cannot run on
                   (moepeak.core.ext.check_cuda_arch) at the first CUDA op.
  MAX_JOBS         parallelism of the CUDA compile (default: the CPUs this process
                   may use): up to MAX_JOBS .cu files side by side, each nvcc
                   compiling its targets on up to MAX_JOBS threads (--threads).
  MOEPEAK_DEBUG=1  -O0 -g.
  MOEPEAK_SANITIZE=address,undefined  build the C code with these -fsanitize=
                   checks (-O1 -g, frame pointers kept), for the sanitizer CI
                   job (.ci/sanitize.sh). The CUDA objects are not instrumented:
                   pair it with MOEPEAK_CUDA=0. Loading the result needs the
                   sanitizer runtime preloaded (LD_PRELOAD=$(gcc
                   -print-file-name=libasan.so)), since python itself is not
                   instrumented.

No torch is imported here, so `pip install .` works with build isolation.
The CUDA runtime is linked statically (libcudart_static), so the extension
does not depend on which libcudart torch ships; NCCL is dlopen'ed at run time.
"""
import glob
import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
# Built where no GPU is found (CI, wheels): A100, A10/RTX 30xx, L40S/RTX 40xx, H100/H200,
# B200/GB200, RTX 50xx/RTX PRO 6000 Blackwell; PTX of the newest for later GPUs.
PORTABLE_ARCHS = ("80", "86", "89", "90", "100", "120")
ARCH_PATTERN = re.compile(r"^[1-9][0-9]{1,2}[af]?$")  # nvcc's numbers: 80, 90a, 100f, 121


def _find_nvcc():
    cands = []
    if os.environ.get("CUDA_HOME"):
        cands.append(os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc"))
    w = shutil.which("nvcc")
    if w:
        cands.append(w)
    cands.append("/usr/local/cuda/bin/nvcc")
    for c in cands:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return os.path.realpath(c)
    return None


def _cuda_home(nvcc):
    """The toolkit root: $CUDA_HOME, else nvcc's grandparent, else /usr/local/cuda
    (nvcc may be a wrapper script outside the toolkit, as in /usr/local/bin)."""
    cands = [os.environ.get("CUDA_HOME"), os.path.dirname(os.path.dirname(nvcc)), "/usr/local/cuda"]
    for c in cands:
        if c and os.path.isfile(os.path.join(c, "include", "cuda_runtime.h")):
            return c
    raise RuntimeError(f"CUDA headers not found for nvcc {nvcc}; set CUDA_HOME")


def _cuda_mode():
    v = os.environ.get("MOEPEAK_CUDA", "").strip()
    if v not in ("", "0", "1"):
        raise RuntimeError(f"MOEPEAK_CUDA must be 0, 1 or unset, got {v!r}")
    return v


def _nvcc_codes(nvcc):
    """The sm_XY targets this nvcc compiles for (nvcc --list-gpu-code), as "XY" strings."""
    out = subprocess.run([nvcc, "--list-gpu-code"], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{nvcc} --list-gpu-code failed: {out.stderr.strip()}")
    return [c[len("sm_"):] for c in out.stdout.split() if c.startswith("sm_")]


def _gpus_present():
    """Compute capabilities of the GPUs nvidia-smi sees, as sorted unique "XY" strings;
    [] when there is no nvidia-smi, no driver or no GPU."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run([smi, "--query-gpu=compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return []
    if out.returncode != 0:
        return []
    caps = {line.strip() for line in out.stdout.splitlines()}
    found = {c.replace(".", "") for c in caps if re.fullmatch(r"[0-9]+\.[0-9]", c)}
    return sorted(found, key=_arch_key)


def _arch_key(arch):
    digits = arch.rstrip("af")
    return (int(digits), arch)


def _cuda_archs(nvcc):
    """(archs to compile for, in order, the last also as PTX; why these)."""
    supported = _nvcc_codes(nvcc)
    raw = os.environ.get("MOEPEAK_CUDA_ARCH", "").strip()
    if raw and raw != "portable":
        archs = [a.strip() for a in raw.split(",")]
        bad = [a for a in archs if not ARCH_PATTERN.match(a)]
        if bad:
            raise RuntimeError(f"MOEPEAK_CUDA_ARCH: expected a comma list of arch numbers like 80,90 or 90a, "
                               f"got {raw!r} (bad: {bad})")
        unknown = [a for a in archs if a.rstrip("af") not in supported]
        if unknown:
            raise RuntimeError(f"MOEPEAK_CUDA_ARCH: {nvcc} cannot compile for {unknown}; it targets sm_"
                               + ", sm_".join(supported))
        return archs, "MOEPEAK_CUDA_ARCH"
    if not raw:
        present = _gpus_present()
        if present:
            unknown = [f"{a[:-1]}.{a[-1]}" for a in present if a not in supported]
            if unknown:
                raise RuntimeError(
                    f"moepeak: the GPU(s) here have compute capability {', '.join(unknown)}, which {nvcc} cannot "
                    f"compile for (it targets sm_{', sm_'.join(supported)}). Build with MOEPEAK_CUDA=0 (CPU only) "
                    f"or name other archs in MOEPEAK_CUDA_ARCH.")
            return present, "the GPUs present (nvidia-smi); MOEPEAK_CUDA_ARCH=portable builds the portable list"
    archs = [a for a in PORTABLE_ARCHS if a in supported]
    if not archs:
        raise RuntimeError(f"moepeak: {nvcc} targets none of sm_{', sm_'.join(PORTABLE_ARCHS)}")
    dropped = [a for a in PORTABLE_ARCHS if a not in supported]
    why = "no GPU found: the portable list" if not raw else "MOEPEAK_CUDA_ARCH=portable"
    return archs, why + (f", less sm_{', sm_'.join(dropped)} this nvcc lacks" if dropped else "")


def _build_jobs():
    raw = os.environ.get("MAX_JOBS", "").strip()
    if raw:
        if not raw.isdigit() or int(raw) < 1:
            raise RuntimeError(f"MAX_JOBS must be a positive integer, got {raw!r}")
        return int(raw)
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


def _run_captured(cmd):
    return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


class BuildExtWithCuda(build_ext):
    """Compiles cuda/*.cu with nvcc into objects and links them into _C."""

    def build_extensions(self):
        mode = _cuda_mode()
        nvcc = None if mode == "0" else _find_nvcc()
        if mode == "1" and nvcc is None:
            raise RuntimeError("MOEPEAK_CUDA=1 but nvcc was not found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin)")
        for ext in self.extensions:
            if nvcc is not None:
                self._add_cuda(ext, nvcc)
            else:
                ext.define_macros.append(("MP_WITH_CUDA", "0"))
        super().build_extensions()

    def _add_cuda(self, ext, nvcc):
        cuda_home = _cuda_home(nvcc)
        archs, why = _cuda_archs(nvcc)
        targets = [f"sm_{a}" for a in archs] + [f"compute_{archs[-1]}"]
        print(f"moepeak: CUDA kernels for {', '.join(targets)} ({why})", flush=True)
        gencode = []
        for a in archs:
            gencode += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
        gencode += ["-gencode", f"arch=compute_{archs[-1]},code=compute_{archs[-1]}"]
        debug = os.environ.get("MOEPEAK_DEBUG") == "1"
        objdir = os.path.join(self.build_temp, "cuda")
        os.makedirs(objdir, exist_ok=True)
        sources = sorted(glob.glob(os.path.join(HERE, "cuda", "*.cu")))
        # Up to `jobs` files side by side, each nvcc compiling its targets on up to `jobs`
        # threads: the small files finish early and the largest (ce_grad.cu, about 10 CPU-s per
        # target) then has every core for its 7 targets.
        jobs = _build_jobs()
        workers = min(len(sources), jobs)
        threads = min(len(archs) + 1, jobs)
        commands, objects = [], []
        for src in sources:
            obj = os.path.join(objdir, os.path.basename(src) + ".o")
            cmd = [nvcc, "-c", src, "-o", obj, "-std=c++17", "-Xcompiler", "-fPIC,-Wall,-Wextra",
                   "-I", os.path.join(HERE, "csrc"), "-I", os.path.join(HERE, "cuda"),
                   "--expt-relaxed-constexpr", "-DMP_WITH_CUDA=1", "--threads", str(threads)] + gencode
            cmd += ["-O0", "-g", "-G"] if debug else ["-O3", "-lineinfo"]
            commands.append(cmd)
            objects.append(obj)
        with ThreadPoolExecutor(workers) as pool:
            for cmd, res in zip(commands, pool.map(_run_captured, commands)):
                print(" ".join(cmd), flush=True)
                if res.stdout:
                    print(res.stdout, end="", flush=True)
                if res.returncode != 0:
                    raise RuntimeError(f"nvcc failed ({res.returncode}) on {cmd[2]}")
        ext.extra_objects = list(ext.extra_objects or []) + objects
        ext.define_macros.append(("MP_WITH_CUDA", "1"))
        ext.define_macros.append(("MP_CUDA_ARCHS", '"' + ",".join(targets) + '"'))
        ext.include_dirs.append(os.path.join(cuda_home, "include"))
        libdir = None
        for d in ("lib64", "lib", os.path.join("targets", "x86_64-linux", "lib"),
                  os.path.join("targets", "sbsa-linux", "lib")):
            if os.path.exists(os.path.join(cuda_home, d, "libcudart_static.a")):
                libdir = os.path.join(cuda_home, d)
                break
        if libdir is None:
            raise RuntimeError(f"libcudart_static.a not found under {cuda_home}")
        ext.library_dirs.append(libdir)
        ext.libraries += ["cudart_static", "rt", "stdc++"]


def _sanitize_flags():
    """-fsanitize flags from MOEPEAK_SANITIZE (a comma list; empty: none)."""
    v = os.environ.get("MOEPEAK_SANITIZE", "").strip()
    if not v:
        return []
    known = {"address", "undefined", "thread", "leak"}
    bad = [s for s in v.split(",") if s.strip() not in known]
    if bad:
        raise RuntimeError(f"MOEPEAK_SANITIZE: unknown sanitizer(s) {bad}; choose from {sorted(known)}")
    # -fno-sanitize-recover: every UBSan finding aborts (a report must fail the run, not scroll by).
    return [f"-fsanitize={v}", "-fno-omit-frame-pointer", "-fno-sanitize-recover=all", "-g", "-O1"]


debug = os.environ.get("MOEPEAK_DEBUG") == "1"
sanitize = _sanitize_flags()
ext = Extension(
    "moepeak._C",
    sources=sorted(glob.glob(os.path.join("csrc", "*.c"))),
    include_dirs=[os.path.join(HERE, "csrc")],
    extra_compile_args=["-std=c11", "-Wall", "-Wextra", "-pthread", "-fvisibility=hidden"]
    + (["-O0", "-g"] if debug else ([] if sanitize else ["-O3"])) + sanitize,
    extra_link_args=["-pthread"] + sanitize,
    libraries=["dl", "m"],
    define_macros=[("_GNU_SOURCE", "1")],
)

setup(ext_modules=[ext], cmdclass={"build_ext": BuildExtWithCuda})

"""Build moepeak._C: a pure-C CPython extension, with CUDA C objects linked in
when nvcc is found.

Environment:
  MOEPEAK_CUDA=0   CPU-only build even if nvcc exists.
  MOEPEAK_CUDA=1   a missing nvcc is an error.
  (unset)          CUDA if nvcc is found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin).
  MOEPEAK_CUDA_ARCH  gencode list, default "90" (sm_90 SASS + compute_90 PTX).
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
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))


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
        archs = os.environ.get("MOEPEAK_CUDA_ARCH", "90").split(",")
        gencode = []
        for a in archs:
            a = a.strip()
            gencode += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
        last = archs[-1].strip()
        gencode += ["-gencode", f"arch=compute_{last},code=compute_{last}"]
        debug = os.environ.get("MOEPEAK_DEBUG") == "1"
        objdir = os.path.join(self.build_temp, "cuda")
        os.makedirs(objdir, exist_ok=True)
        objects = []
        for src in sorted(glob.glob(os.path.join(HERE, "cuda", "*.cu"))):
            obj = os.path.join(objdir, os.path.basename(src) + ".o")
            cmd = [nvcc, "-c", src, "-o", obj, "-std=c++17", "-Xcompiler", "-fPIC,-Wall,-Wextra",
                   "-I", os.path.join(HERE, "csrc"), "-I", os.path.join(HERE, "cuda"),
                   "--expt-relaxed-constexpr", "-DMP_WITH_CUDA=1"] + gencode
            cmd += ["-O0", "-g", "-G"] if debug else ["-O3", "-lineinfo"]
            print(" ".join(cmd), flush=True)
            subprocess.check_call(cmd)
            objects.append(obj)
        ext.extra_objects = list(ext.extra_objects or []) + objects
        ext.define_macros.append(("MP_WITH_CUDA", "1"))
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

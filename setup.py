"""Declares the host_index C extension; all metadata lives in setup.cfg."""
import os

import setuptools

# KVJAX_SANITIZE=1 builds with AddressSanitizer + UBSan (.ci/host_index_sanitizers.sh).
_SAN = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-O1", "-g"]
_SAN = _SAN if os.environ.get("KVJAX_SANITIZE") == "1" else []
_SRC = "host_index/csrc/"

setuptools.setup(ext_modules=[setuptools.Extension(
    "host_index._core",
    sources=[_SRC + f for f in ("module.c", "hi_index.c", "hi_kernels.c", "hi_graph.c",
                                "hi_ivf.c", "hi_attend.c", "hi_slots.c", "hi_gate.c", "hi_topk.c")],
    depends=[_SRC + f for f in ("hi_common.h", "hi_heap.h", "hi_index.h", "hi_kernels.h",
                                "hi_kernels_impl.h", "hi_attend.h", "hi_slots.h", "hi_gate.h",
                                "hi_topk.h")],
    extra_compile_args=["-std=c11", "-O3", "-fopenmp", "-ffp-contract=fast",
                        "-Wall", "-Wextra", "-Wno-unused-parameter"] + _SAN,
    extra_link_args=["-fopenmp"] + _SAN[:1],
)])

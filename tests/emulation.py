"""A grid kernel compiled by the host's C++ compiler for tests/cuda_on_cpu's emulation of the CUDA
features it uses (a thread per CUDA thread; a warp's mma.sync, movmatrix and shuffles from its lanes'
registers as PTX lays them out; block and grid barriers of threads): what the host compiler cannot
take replaced, the shape's defines before the source, a launch harness after it."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path

import pytest

from graphtrain.kernels import KERNELS_DIR

HARNESS = KERNELS_DIR.parents[1] / "tests" / "cuda_on_cpu"
# The block's dynamic shared memory (the launch's own buffer), the grid barrier's release fence and
# arrival (the compiler's fence and fetch-add) and its acquire load (the compiler's, and a yield: a
# thread per CUDA thread), the kernels' qualifiers.
REPLACED = {'extern __shared__ __align__(16) unsigned char smem_raw[];': 'unsigned char* smem_raw = block_smem();',
            'asm volatile("fence.acq_rel.gpu;\\n\\tatom.relaxed.gpu.global.add.u64 %0, [%1], 1;"\n'
            '                     : "=l"(arrived) : "l"(counter) : "memory");':
                'std::atomic_thread_fence(std::memory_order_acq_rel); '
                'arrived = __atomic_fetch_add(counter, 1ull, __ATOMIC_RELAXED);',
            'asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(now) : "l"(counter) : "memory");':
                'now = __atomic_load_n(counter, __ATOMIC_ACQUIRE); std::this_thread::yield();',
            'extern "C" __global__ void': 'void'}
# tf32_mma.cuh's mma_tf32 and mma_tf32_k4 (an asm statement each), replaced by tf32.h's emulations,
MMA_ASM = re.compile(r'asm volatile\("mma\.sync\.aligned\.m16n8k8\.row\.col\.f32\.tf32\.tf32\.f32.*?\);', re.S)
MMA_K4_ASM = re.compile(r'asm volatile\("mma\.sync\.aligned\.m16n8k4\.row\.col\.f32\.tf32\.tf32\.f32.*?\);', re.S)
# and its ldmatrix_tf32 (one asm statement), replaced by tf32.h's ldmatrix_tf32_emulated
LDMATRIX_ASM = re.compile(r'asm volatile\("ldmatrix\.sync\.aligned\.m8n8\.x4\.shared\.b16.*?\);', re.S)


def kernel_text(*names: str) -> str:
    """The text of kernels/ files `names`, joined: a kernel file and the headers it needs that the
    emulation does not provide itself (tf32_mma.cuh's and async_copy.cuh's are in cuda_on_cpu/)."""
    return "".join((KERNELS_DIR / name).read_text(encoding="utf-8") for name in names)


def compile_for_cpu(source: str, kernel: str, defines: dict, header: str, launch: str, folder: Path,
                    replaced: Mapping[str, str] = REPLACED) -> str:
    """The program (its path) of `source` (kernel file `kernel`'s, with what it includes) after
    `#include header` and the defines, followed by the harness file `launch`, built in `folder`;
    `replaced`: the texts the host compiler cannot take and what it takes instead (the grid kernels'
    REPLACED by default), each of which the source must have."""
    compiler = shutil.which("g++")
    if compiler is None:
        pytest.skip("no g++ to compile the kernel for the CPU")
    for old, new in replaced.items():
        assert old in source, f"{kernel} no longer has {old!r}: the emulation must follow it"
        source = source.replace(old, new)
    stem = Path(kernel).stem
    text = (f'#include "{header}"\n' + "".join(f"#define {k} {v}\n" for k, v in defines.items()) + source
            + (HARNESS / launch).read_text())
    (folder / f"{stem}.cpp").write_text(text)
    program = str(folder / stem)
    proc = subprocess.run([compiler, "-O1", "-std=c++20", "-pthread", "-w", "-I", str(HARNESS), "-o", program,
                           str(folder / f"{stem}.cpp")], capture_output=True, text=True)
    if proc.returncode and "barrier" in proc.stderr and "No such file" in proc.stderr:
        pytest.skip(f"{compiler} has no C++20 <barrier>")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return program

"""scripts/probes/ncu_source_lines.py: Nsight Compute's source page (CUDA lines with their SASS, as CSV)
summed by CUDA line, and the stall reasons over every instruction counted once."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "probes"))
import ncu_source_lines  # noqa: E402  (scripts/ is no package)

HEADER = ('"Line No","Source","Address","Source","Warp Stall Sampling (All Samples)",'
          '"Warp Stall Sampling (Not-issued Samples)","stall_barrier","stall_long_sb","stall_barrier (Not Issued)"')


def test_samples_are_summed_by_cuda_line_and_every_instruction_counts_once(tmp_path):
    """Two files' sections, as ncu prints an inlined function: its instruction at 0x20 listed under the
    header's line and again under the caller's; the line totals come from the CUDA rows, the stall
    reasons from each address once."""
    csv_text = "\n".join([
        '"File Path","/src/graphtrain/kernels/cluster.cuh"', '"Function Name","wide_epoch"', HEADER,
        '"10","cluster_sync();","-","-","7","7","5","2","5"',
        '"","","0x20","      UCGABAR_WAIT","7","7","5","2","5"',
        '"File Path","/src/graphtrain/kernels/persistent_wide.cu"', '"Function Name","wide_epoch"', HEADER,
        '"900","cluster_sync();  // dht","-","-","7","7","5","2","5"',
        '"","","0x20","      UCGABAR_WAIT","7","7","5","2","5"',
        '"901","load(a, k);","-","-","3","3","0","3","0"',
        '"","","0x30","      LDG.E.64","3","3","0","3","0"',
        '"","","...","...","-","-","-","-","-"',
    ]) + "\n"
    path = tmp_path / "source.csv"
    path.write_text(csv_text, encoding="utf-8")
    samples, detail, overall = ncu_source_lines.source_lines(str(path))
    assert samples == {("cluster.cuh", 10): 7, ("persistent_wide.cu", 900): 7, ("persistent_wide.cu", 901): 3}
    assert detail[("persistent_wide.cu", 901)][0] == "load(a, k);"
    assert detail[("persistent_wide.cu", 901)][1] == {"barrier": 0, "long_sb": 3}
    assert overall == {"barrier": 5, "long_sb": 5}  # 0x20 once, 0x30 once; "Not Issued" columns left out

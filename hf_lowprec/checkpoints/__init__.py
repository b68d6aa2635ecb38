"""Checkpoints: what is written, checked and read back, on one floor over `memory` and `fp8`.

`resume` (every check and refusal before a resume), `complete_save` (complete on every rank before
rotation), `manifest` (each file's size and CRC-32), `sharded` and `fsdp2` (FSDP2's sharded
checkpoints), `fp8_published` and `published_experts` (published FP8 checkpoints in and out),
`converted` (MoE experts read back from the hub format). docs/checkpoints.md tells the rules.
"""

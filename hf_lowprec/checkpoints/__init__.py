"""Checkpoints: what is written, checked and read back, on one floor over `memory` and `fp8`.

- `resume`: every check before a resume and every refusal of one (missing or damaged files,
  another strategy's checkpoint, changed options, sharded and ZeRO layouts; `resume_reset`);
- `complete_save`: the Trainer's checkpoints made complete on every rank before rotation;
- `manifest`: the `hf_lowprec_manifest.json` every checkpoint carries (each file's size and CRC-32);
- `sharded` and `fsdp2`: FSDP2's sharded checkpoints, saved atomically and checked the same way;
- `fp8_published`: FP8 checkpoints as they are published (E4M3 + per-block scales), in and out;
  `published_experts`: the fused experts of FP8 Mixture-of-Experts releases.
- `converted`: a resume reads MoE experts back from the per-expert format transformers writes.

docs/checkpoints.md tells the rules; the integrations call these.
"""

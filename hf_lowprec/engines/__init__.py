"""The distributed engines, one module each, where the engine meets a precision strategy.

- `ddp`: torch DistributedDataParallel (`prepare_ddp`: the refusal, the process group, the
  strategy's communication hook);
- `fsdp2`: FSDP2 `fully_shard` (`shard_model`, the Trainer/Accelerate path, sharded checkpoints);
- `fsdp2_fp8`: FP8-LM's weights under FSDP2 (the FP8 all-gather extension, the weight scales
  agreed in one all-reduce, the sharded gradients quantized with the global amax), which the
  FP8-LM strategies apply before and after sharding (a lower layer);
- `traffic`: what each engine's collectives carry per strategy (the generated table);
- `zero`: DeepSpeed ZeRO 1/2/3 (the precision entries of the config, the refusals, the client
  optimizer);

FP8-LM's own ZeRO stage, the optimizer of fp8-lm-o3, is an optimizer: `hf_lowprec.optim.zero_fp8`.

What an engine may do with a strategy is declared on the strategy class (`ddp`, `ddp_refusal`,
`fsdp2`, `fsdp2_refusal`, `zero_stages`, `zero_refusal`): the engines and every engines table in
the docs read those declarations. This file imports nothing, so that `fsdp2_fp8`,
which the strategies use (a lower layer than the other engines), imports without the engines
above it.
"""

"""The distributed engines, one module each, where the engine meets a precision strategy.

- `ddp`: torch DistributedDataParallel (`prepare_ddp`: the refusal, the process group, the
  strategy's communication hook);
- `fsdp2`: FSDP2 `fully_shard` (`shard_model`, the Trainer/Accelerate path, sharded checkpoints);
- `fsdp2_fp8`: FP8-LM's weights under FSDP2 (the FP8 all-gather extension, the weight scales
  agreed in one all-reduce, the sharded gradients quantized with the global amax), which the
  FP8-LM strategies apply before and after sharding (a lower layer, as `zero_fp8`);
- `traffic`: what each engine's collectives carry per strategy (the generated table);
- `zero`: DeepSpeed ZeRO 1/2/3 (the precision entries of the config, the refusals, the client
  optimizer);
- `zero_fp8`: FP8-LM's own ZeRO stage (`FP8ZeroAdamW`: whole FP8 weights per rank), the optimizer
  of fp8-lm-o3, which runs in one process, under DDP and as DeepSpeed ZeRO's client optimizer.

What an engine may do with a strategy is declared on the strategy class (`ddp`, `ddp_refusal`,
`fsdp2`, `fsdp2_refusal`, `zero_stages`, `zero_refusal`): the engines and every engines table in
the docs read those declarations. This file imports nothing, so that `zero_fp8` and `fsdp2_fp8`,
which the strategies use (a lower layer than the other engines), import without the engines
above them.
"""

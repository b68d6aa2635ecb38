"""The distributed engines, one module each, where the engine meets a precision strategy.

- `ddp`: torch DistributedDataParallel (`prepare_ddp`: the refusal, the process group, the
  strategy's communication hook);
- `fsdp2`: FSDP2 `fully_shard` (`shard_model`, the Trainer/Accelerate path; its sharded
  checkpoints are in `hf_lowprec.checkpoints`);
- `traffic`: what each engine's collectives carry per strategy (the generated table);
- `zero`: DeepSpeed ZeRO 1/2/3 (the precision entries of the config, the refusals, the client
  optimizer).

What the strategies themselves bring to an engine lives with their numerics, a floor below:
FP8-LM's weights under FSDP2 (the FP8 all-gather) in `hf_lowprec.fp8.sharded_weight`, its own ZeRO stage
in `hf_lowprec.optim.zero_fp8`. What an engine may do with a strategy is declared on the
strategy class, one frozen `EngineSupport` (`hf_lowprec.strategies.support`: `ddp`, `fsdp2`,
`zero_stages`, each with its note and refusal): the engines and every engines table in the docs read those declarations. Every engine takes a
strategy object; a name is resolved where it enters (`get_strategy`).
"""

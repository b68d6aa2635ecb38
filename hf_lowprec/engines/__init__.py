"""The distributed engines, one module each, where the engine meets a precision strategy: `ddp`
(torch DDP), `fsdp2` (`fully_shard`), `zero` (DeepSpeed ZeRO 1/2/3) and `traffic` (what each
engine's collectives carry per strategy). Every engine takes a strategy object (a name is resolved
where it enters: `hf_lowprec.get_strategy`).

What an engine may do with a strategy is declared on the strategy class
(`strategies.support.EngineSupport`); what a strategy brings to an engine lives with its numerics
(`fp8.sharded_weight`, `optim.zero_fp8`).
"""

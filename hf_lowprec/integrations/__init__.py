"""Glue between precision strategies and the HuggingFace stack (Trainer, Accelerate, TRL, PEFT)."""

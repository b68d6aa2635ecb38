"""Planning a run before renting a GPU (docs/planning.md): the step ledger (`ledger`: kernels,
bytes, FLOPs, syncs of one step, counted on CPU at a GPU run's shapes), the GPUs' numbers and
the measured rows that check them (`gpus`), the roofline that turns a ledger into a step time
(`roofline`), communication past one GPU (`communication`), and `plan`, what `hf-lowprec plan`
prints.
"""

"""Plan -> torch.distributed: the executor. It imports the Plan type and never searches.

What runs, in this fixed order (each step names its module):
1. Launch (`executor.launch`): torch's elastic launcher with torchrun's flags and environment, or
   in-process when already under torchrun (RANK/WORLD_SIZE/LOCAL_RANK set). gloo on CPU, NCCL on CUDA.
   A world size other than the plan's is refused before any work.
2. Build (`executor.model`): the plan's HF config on the meta device, normalized for TP (GPT-2's
   Conv1D -> Linear).
3. Apply the plan (`executor.api.parallelize`), in order:
   1. pipeline split (`executor.pipeline`, torchtitan style: per-stage copies with other layers deleted;
      embeddings tied across the first and last stage are two copies whose gradients are summed);
   2. tensor/sequence parallel (`executor.tensor_parallel`, DTensor `parallelize_module` with the
      plan's tp_plan, attention head counts made local), then expert parallel
      (`executor.expert_parallel`: MoE experts sharded by expert over the ep ranks borrowed from
      dp_shard x cp, tokens dispatched and combined by all-to-all);
   3. context parallel (`executor.context_parallel`, an all-gather-K/V attention);
   4. activation checkpointing per block (HF's layer checkpointing, full or selective);
   5. mixed precision (`executor.precision`: bf16, fp16 + GradScaler, tf32, fp8 via torchao);
   6. torch.compile per block when the plan asks;
   7. data parallel (`executor.data_parallel`): FSDP2 (zero 3; zero 2 = no reshard after forward;
      HSDP on a 2-D mesh; CPUOffloadPolicy when the plan offloads; with ep > 1 the experts first, over
      the ranks holding the same experts, gradients divided by dp*cp) on the meta model, then materialization of only this rank's shards
      (`executor.model.materialize`: seeded per FQN, so every layout starts from the same weights, or
      `--weights`), then DDP (zero 0) or DDP + ZeroRedundancyOptimizer (zero 1).
4. Train (`executor.train`): the same global batch per step in every layout (`executor.data`), losses
   normalized so gradients equal the single-process ones, the planned optimizer, logging and a
   measured-vs-predicted report.
5. Checkpoint (`executor.checkpoint`): DCP every N steps, saved atomically; `--resume`.
"""

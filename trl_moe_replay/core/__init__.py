"""What both trainers share: the routes' path through a trainer, the routing options, the metrics and the launch checks.

``route_flow`` (routes from intake to every forward), ``routing_options`` (the replay mode as a type, the options
resolved once), ``config_checks`` (what both configs check), ``metrics`` (mismatch and routing-agreement metrics),
``peft_replay`` (which adapters can be replayed), ``launch`` (what the launch asked for against what the trainer
got), ``output_lock`` (one trainer per output directory), ``precision`` (updates that round away) and
``model_card``. ``MoEReplayGRPOTrainer`` (:mod:`trl_moe_replay.trainer`) and ``MoEReplayAsyncGRPOTrainer``
(:mod:`trl_moe_replay.async_grpo`) build on it; nothing here imports either trainer.
"""

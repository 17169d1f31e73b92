"""The one model server: N members by role (label expert, text expert, text encoder, decoder,
router network) on one device, each a :class:`~ddm.serving.model.stage.StageMember` of the
stage :func:`~ddm.models.stages.load_stage` loads, with its batcher, context cache and limits
behind one member interface (:mod:`~ddm.serving.model.member`); one memory check at start
(:mod:`~ddm.serving.model.memory`). :mod:`~ddm.serving.model.server` builds the app from
:class:`~ddm.serving.model.options.ServingOptions`; ``ddm serve expert``, ``stage`` and
``pool`` all run it."""

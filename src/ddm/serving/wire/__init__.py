"""The wire between the router and the model servers: the message format
(:mod:`~ddm.serving.wire.protocol`) and the paths a model server answers at
(:mod:`~ddm.serving.wire.paths`). It imports nothing of either side."""

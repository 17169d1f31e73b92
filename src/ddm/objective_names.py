"""The names an expert may declare for its objective (``ddm.objectives`` converts them), and
the frameworks it may be trained in.

Plain tuples without NumPy, so that the CLI can offer them without importing the conversions,
and the deployment plan (``ddm.deploy.limits``) and the checkpoint format share them.
"""

#: The frameworks an expert is trained in (a checkpoint's ``framework``, a stage's, an exported
#: program's).
FRAMEWORKS = ("torch", "jax")
#: What an expert or stage is in where its spec says nothing.
DEFAULT_FRAMEWORK = FRAMEWORKS[0]

PREDICTIONS = ("velocity", "epsilon", "sample", "v_prediction")
SCHEDULES = ("linear", "rectified-flow", "vp-linear", "vp-cosine")
TIMES = ("continuous", "discrete", "sigma")
#: Schedules whose paths are straight lines between noise and data (the rest are VP).
FLOW_SCHEDULES = ("linear", "rectified-flow")

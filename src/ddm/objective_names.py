"""The names an expert may declare for its objective (``ddm.objectives`` converts them).

Plain tuples without NumPy, so that the CLI can offer them without importing the conversions.
"""

PREDICTIONS = ("velocity", "epsilon", "sample", "v_prediction")
SCHEDULES = ("linear", "rectified-flow", "vp-linear", "vp-cosine")
TIMES = ("continuous", "discrete", "sigma")
#: Schedules whose paths are straight lines between noise and data (the rest are VP).
FLOW_SCHEDULES = ("linear", "rectified-flow")

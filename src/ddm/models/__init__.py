"""The networks we serve and train, and their loading in each framework."""

import warnings

# The serving protocol decodes requests into read-only views of the body, and the batcher hands
# a lone request's views to the model as they are (no copy). Models read their inputs and
# never write them, so torch's warning that such an array is not writable says nothing useful:
# users saw it on every server's first request (an expert's, a stage's). Set here, where every
# model module is loaded from, so that no server process misses it.
warnings.filterwarnings("ignore", message="The given NumPy array is not writable",
                        category=UserWarning)

"""Judging generated digits: a classifier's features, Frechet distance, precision/recall and
density/coverage against matched real subsets, and the real-vs-real floor.

Nothing is imported here: ``ddm eval``'s arguments (``evaluation.cli``) are read by every
``ddm`` command, which must not pay for PyTorch; import the submodules themselves.
"""

"""The shipped checkpoints, installed as package data: ``tiny-austen/`` and
``tiny-tasks/`` (the tiny decoder's weights) and ``estimator/`` (the pretrained learned
estimator). Each folder's README says how it was made.

Read them with ``importlib.resources.files("flsmem.checkpoints")``.
"""

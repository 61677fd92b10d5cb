"""Training scripts: ``train_decoder`` (the tiny decoder, resumable) and
``train_estimator`` (pretraining the learned estimator). Installed as ``flsmem.train``;
run them as ``python -m flsmem.train.train_decoder``."""

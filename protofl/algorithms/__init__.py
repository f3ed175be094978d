"""protofl.algorithms: the techniques' numpy math and server rules, one module per technique.

Each technique module opens with the paper and equations it implements, then the client half (pure
functions), then the server half as a small streaming accumulator (`add(...)`, `result()`) whose
memory does not grow with the number of uploads, and last the technique itself (its options, plan
contributions and server rule; protofl/technique.py). Prototype tables are `dict[int, np.ndarray]`
(class id -> vector); sums are kept in float64 and results returned as float32. Shared math that more
than one technique uses lives in modules named for what it is (unit prototypes, support masks,
scaling, robust clipping).
"""
# The modules, by paper (docs/algorithms.md has the equations):
#   fedavg   FedAvg (McMahan et al. 2017): sample-weighted mean of parameter vectors.
#   fedproto FedProto (Tan et al. 2022): local prototypes, weighted / mean aggregation, nearest-prototype.
#   apud     RefProtoFL APUD (paper 000, Alg. 1-2, eqs. 3-7): Top-K adapter upload, masked aggregation.
#   erpa     RefProtoFL ERPA (paper 000, Alg. 3-5, eqs. 10-16): external and global prototypes, anchors.
#   cps      TinyProto CPS (paper 002, eqs. 7-8): class masks, packing; with scaling (eqs. 10-11).
#   fedpagr  FedPAGR (paper 004, eqs. 4-6): geometric refinement; unit.py has its eqs. 2-3.
#   support  per-class support masks: compression, reconstruction, restriction (used by every rule).
#   unit     unit prototypes on the sphere: client mean and server consensus.
#   scaling  n-scaled prototypes and their aggregation, mu and "auto".
#   robust   clipping and coordinate-wise robust means (Yin et al. 2018).

"""protofl.algorithms: the server-side algorithm math, numpy only, one module per technique.

Each module opens with the paper and equations it implements, then the client half (pure
functions), then the server half as a small streaming accumulator (`add(...)`, `result()`) whose
memory does not grow with the number of uploads. Prototype tables are `dict[int, np.ndarray]`
(class id -> vector); sums are kept in float64 and results returned as float32.

- fedavg   FedAvg (McMahan et al. 2017): sample-weighted mean of dense vectors.
- fedproto FedProto (Tan et al. 2022): local prototypes, weighted / mean aggregation, nearest-prototype.
- apud     RefProtoFL APUD (paper 000, Alg. 1-2, eqs. 3-7): Top-K adapter upload, masked aggregation.
- erpa     RefProtoFL ERPA (paper 000, Alg. 3-5, eqs. 10-16): external and global prototypes, anchors.
- cps      TinyProto CPS (paper 002, eqs. 7-8): class masks, compression, reconstruction, packing.
- scaling  TinyProto prototype scaling (paper 002, eqs. 10-11): n-scaled aggregation, mu, auto.
- refine   FedPAGR (paper 004, eqs. 2-6): consensus aggregation and geometric refinement.
"""

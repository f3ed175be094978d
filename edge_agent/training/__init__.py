"""The client model and its local training (torch): the model zoo, parameter flattening, the trainer
and the shared backbone; the techniques' device rules build on it."""

"""Scale-out inside one model instance: tensor parallelism over ``torch.distributed``.

* :mod:`.tensor_parallel` says which slice of each tensor a rank holds (Megatron-style) and
  runs the two collectives a decoder step needs (all-reduce, vocab all-gather);
* :mod:`.ranks` starts the ranks of an instance, replays every backend call of rank 0 on
  the others, and fails the instance fast when a rank dies;
* :mod:`.cores` counts the cores this process may use and shares them out (ranks, servers, test workers).
"""

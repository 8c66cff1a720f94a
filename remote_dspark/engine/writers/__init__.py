"""What writes a round into the shared region: the metadata and the rows.

native_meta    the host metadata by one C call (``hf_host_meta``)
host_round     a CPU engine's whole host round in C (``hf_host_round``, ``hf_host_answer``)
device_meta    the metadata on the device, written in stream order by two Triton launches
gather         the rows of an engine tensor into the staging slot (torch or Triton)
native_launch  launch()'s stream work in one C call (``hf_cuda_launch``)
"""

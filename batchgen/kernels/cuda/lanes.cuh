// Body fragment of the batch attention kernels (included inside a kernel body).
// A block reads one row's columns for one query head or (attend.cuh's QB) all of a kv
// head's. A column (position) is
// read by LPC = D / 8 lanes, 8 coordinates each, so a warp reads CPW = 32 / LPC columns
// at once, UNROLL rounds of them together (their loads in flight together: one key after
// another would wait on memory latency). (A lane per D / 32 coordinates and a column a
// warp at a time spent most of a column's instructions on the 5-step shuffle sum and the
// column's bookkeeping.)
  constexpr int PER = 8, LPC = D / PER, CPW = 32 / LPC, NP = WARPS * CPW;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int grp = lane / LPC, sub = lane % LPC, pid = warp * CPW + grp;
  const float sc = scale[0];


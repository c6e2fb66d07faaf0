// Body fragment: a batch step's positions (window.cuh) read by the attention body.
#include "window.cuh"
  #define KEY(j) ((j) < base ? k + (row * cap + (j)) * D : (j) < base + used ? rk + (row * W + (j) - base) * D : KN)
  #define VAL(j) ((j) < base ? v + (row * cap + (j)) * D : (j) < base + used ? rv + (row * W + (j) - base) * D : VN)
#include "attend.cuh"


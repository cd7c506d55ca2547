#include "core/fused_dot.h"

namespace mjolnir {

bool host_fuses_dot_products() {
#if defined(__FP_FAST_FMAF)
  return true;
#else
  return false;
#endif
}

}  // namespace mjolnir

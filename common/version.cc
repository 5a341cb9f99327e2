#include "common/version.h"

namespace kvtier {

const char* Version() { return KVTIER_VERSION; }

}  // namespace kvtier

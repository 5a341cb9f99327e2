// The version of this build of kvtier: CMake's project version, the same in
// every binary (--version), kvctl version, the kvtier_build_info metric, the
// Python package (kvtier.__version__) and the Helm chart's appVersion.
#pragma once

namespace kvtier {

const char* Version();

}  // namespace kvtier

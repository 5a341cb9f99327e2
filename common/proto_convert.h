// Conversions between the project's block-identity types and their kvtier.v1
// wire messages, in one place.
#pragma once

#include "common/block_key.h"
#include "kvtier/v1/common.pb.h"

namespace kvtier {

void ToProto(const BlockHash& h, v1::BlockHash* out);
BlockHash FromProto(const v1::BlockHash& h);
void ToProto(const NamespaceSpec& s, v1::NamespaceSpec* out);
NamespaceSpec FromProto(const v1::NamespaceSpec& p);

}  // namespace kvtier

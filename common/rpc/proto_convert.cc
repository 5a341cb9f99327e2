#include "common/rpc/proto_convert.h"

namespace kvtier {

void ToProto(const BlockHash& h, v1::BlockHash* out) {
  out->set_hi(h.hi);
  out->set_lo(h.lo);
}

BlockHash FromProto(const v1::BlockHash& h) { return BlockHash{h.hi(), h.lo()}; }

void ToProto(const NamespaceSpec& s, v1::NamespaceSpec* out) {
  out->set_model(s.model);
  out->set_dtype(s.dtype);
  out->set_layers(s.layers);
  out->set_kv_heads(s.kv_heads);
  out->set_head_dim(s.head_dim);
  out->set_block_tokens(s.block_tokens);
  out->set_tp_rank(s.tp_rank);
  out->set_tp_size(s.tp_size);
  out->set_cache_salt(s.cache_salt);
  out->set_kv_wire(s.kv_wire);
  out->set_layout(s.layout);
}

NamespaceSpec FromProto(const v1::NamespaceSpec& p) {
  return NamespaceSpec{p.model(),      p.dtype(),        p.layers(),  p.kv_heads(),
                       p.head_dim(),   p.block_tokens(), p.tp_rank(), p.tp_size(),
                       p.cache_salt(), p.kv_wire(),      p.layout()};
}

}  // namespace kvtier

/* The C ABI of kvtier-text (frontend/text/src/lib.rs): a model's own
 * tokenizer and chat template. Every call may run on any thread at once on
 * the same handle. A failed call returns a nonzero KVT_TEXT_* code and, when
 * `err` is not null, a message to free with kvt_text_free_string. */
#ifndef KVTIER_FRONTEND_TEXT_TEXT_H_
#define KVTIER_FRONTEND_TEXT_TEXT_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KVT_TEXT_INVALID 1  /* the input was wrong (a client's error) */
#define KVT_TEXT_MODEL 2    /* the model's files are wrong or missing */
#define KVT_TEXT_INTERNAL 3 /* a failure inside the library */

typedef struct KvtText KvtText;

/* Opens the model in `dir` (tokenizer.json; tokenizer_config.json and
 * chat_template.jinja when present). Null on failure. */
KvtText* kvt_text_open(const char* dir, char** err);
void kvt_text_close(KvtText* text);
int kvt_text_has_chat_template(const KvtText* text);
size_t kvt_text_vocab_size(const KvtText* text);

/* Token ids of `len` bytes of UTF-8; with the model's special tokens when
 * add_special_tokens. *ids (free with kvt_text_free_ids) and *n on 0. */
int kvt_text_encode(const KvtText* text, const char* utf8, size_t len, int add_special_tokens,
                    uint32_t** ids, size_t* n, char** err);

/* The chat request (JSON: messages, add_generation_prompt (default true),
 * tools, documents, chat_template_kwargs) rendered through the model's
 * template: *out, NUL-terminated, *out_len bytes (free with
 * kvt_text_free_string) on 0. */
int kvt_text_render_chat(const KvtText* text, const char* request_json, size_t len, char** out,
                         size_t* out_len, char** err);

void kvt_text_free_ids(uint32_t* ids, size_t n);
void kvt_text_free_string(char* s);

#ifdef __cplusplus
}
#endif

#endif /* KVTIER_FRONTEND_TEXT_TEXT_H_ */

//! The frontend's text layer behind a C ABI (frontend/text/text.h): a
//! model's own tokenizer (`tokenizer.json`, Hugging Face `tokenizers`) and
//! chat template (`tokenizer_config.json`'s `chat_template`, or
//! `chat_template.jinja`), rendered with `minijinja` the way Hugging Face's
//! `apply_chat_template` renders it with Jinja2 (trim_blocks, lstrip_blocks,
//! loop controls, Python's string and dict methods, `raise_exception`).
//!
//! Every entry point catches panics: nothing unwinds into C++. Errors come
//! back as a code and a message the caller frees.

// Every extern "C" function takes pointers as text.h states (valid for the
// lengths given, handles from kvt_text_open); that header is their safety contract.
#![allow(clippy::missing_safety_doc)]

use std::ffi::{c_char, c_int, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;

use minijinja::syntax::SyntaxConfig;
use minijinja::value::Serde;
use minijinja::{Environment, Error, ErrorKind};
use serde_json::{Map, Value as Json};
use tokenizers::Tokenizer;

/// A return code: the input was wrong (a bad request: HTTP 400).
pub const KVT_TEXT_INVALID: c_int = 1;
/// A return code: the model's files are wrong or missing.
pub const KVT_TEXT_MODEL: c_int = 2;
/// A return code: a failure of this library (a panic caught).
pub const KVT_TEXT_INTERNAL: c_int = 3;

/// One model's tokenizer and chat template. Read-only once opened: every
/// call may run on any thread at once.
pub struct KvtText {
    tokenizer: Tokenizer,
    env: Option<Environment<'static>>,
    // bos_token, eos_token, unk_token, pad_token as tokenizer_config.json names them.
    special: Map<String, Json>,
}

fn error_string(err: *mut *mut c_char, msg: String) {
    if err.is_null() {
        return;
    }
    let clean = msg.replace('\0', " ");
    unsafe {
        *err = CString::new(clean)
            .map(CString::into_raw)
            .unwrap_or(std::ptr::null_mut());
    }
}

// A special token's text: a plain string, or an AddedToken's "content".
fn token_text(v: &Json) -> Option<String> {
    match v {
        Json::String(s) => Some(s.clone()),
        Json::Object(o) => o.get("content").and_then(|c| c.as_str()).map(str::to_owned),
        _ => None,
    }
}

// The template a request uses: a string, or the entry named "default" of a
// list of {name, template}.
fn pick_template(v: &Json) -> Option<String> {
    match v {
        Json::String(s) => Some(s.clone()),
        Json::Array(list) => list.iter().find_map(|t| {
            (t.get("name").and_then(Json::as_str) == Some("default"))
                .then(|| t.get("template").and_then(Json::as_str).map(str::to_owned))
                .flatten()
        }),
        _ => None,
    }
}

fn raise_exception(msg: String) -> Result<String, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

fn open(dir: &Path) -> Result<KvtText, (c_int, String)> {
    let model = |m: String| (KVT_TEXT_MODEL, m);
    let tok_path = dir.join("tokenizer.json");
    let tokenizer = Tokenizer::from_file(&tok_path)
        .map_err(|e| model(format!("cannot load {}: {e}", tok_path.display())))?;
    let mut special = Map::new();
    let mut template = None;
    let cfg_path = dir.join("tokenizer_config.json");
    if cfg_path.exists() {
        let text = std::fs::read_to_string(&cfg_path)
            .map_err(|e| model(format!("cannot read {}: {e}", cfg_path.display())))?;
        let cfg: Json = serde_json::from_str(&text)
            .map_err(|e| model(format!("{} is not JSON: {e}", cfg_path.display())))?;
        for name in ["bos_token", "eos_token", "unk_token", "pad_token"] {
            if let Some(t) = cfg.get(name).and_then(token_text) {
                special.insert(name.to_owned(), Json::String(t));
            }
        }
        template = cfg.get("chat_template").and_then(pick_template);
    }
    // Newer models keep the template in a file of its own, which wins.
    let jinja_path = dir.join("chat_template.jinja");
    if jinja_path.exists() {
        template = Some(
            std::fs::read_to_string(&jinja_path)
                .map_err(|e| model(format!("cannot read {}: {e}", jinja_path.display())))?,
        );
    }
    let env = match template {
        None => None,
        Some(src) => {
            let mut env = Environment::new();
            let syntax = SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .build()
                .map_err(|e| (KVT_TEXT_INTERNAL, e.to_string()))?;
            env.set_syntax(syntax);
            env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
            env.add_function("raise_exception", raise_exception);
            env.add_template_owned("chat", src)
                .map_err(|e| model(format!("the chat template does not compile: {e}")))?;
            Some(env)
        }
    };
    Ok(KvtText {
        tokenizer,
        env,
        special,
    })
}

// OpenAI content as a list of parts: the text parts joined by newlines (what
// vLLM does for templates that take content as a string).
fn flatten_content(message: &mut Json) -> Result<(), String> {
    let Some(content) = message.get_mut("content") else {
        return Ok(());
    };
    if let Json::Array(parts) = content {
        let mut texts = Vec::with_capacity(parts.len());
        for p in parts.iter() {
            match (
                p.get("type").and_then(Json::as_str),
                p.get("text").and_then(Json::as_str),
            ) {
                (Some("text"), Some(t)) => texts.push(t.to_owned()),
                (kind, _) => {
                    return Err(format!(
                        "content part of type {} is not supported (text parts only)",
                        kind.unwrap_or("(none)")
                    ))
                }
            }
        }
        *content = Json::String(texts.join("\n"));
    }
    Ok(())
}

fn render(text: &KvtText, request: &str) -> Result<String, (c_int, String)> {
    let invalid = |m: String| (KVT_TEXT_INVALID, m);
    let Some(env) = &text.env else {
        return Err(invalid("the model has no chat template".to_owned()));
    };
    let req: Json = serde_json::from_str(request).map_err(|e| invalid(format!("not JSON: {e}")))?;
    let Json::Object(req) = req else {
        return Err(invalid(
            "the render request is not a JSON object".to_owned(),
        ));
    };
    let mut ctx = Map::new();
    // chat_template_kwargs first: the fields below are not theirs to replace.
    if let Some(kw) = req.get("chat_template_kwargs") {
        let Json::Object(kw) = kw else {
            return Err(invalid("chat_template_kwargs is not an object".to_owned()));
        };
        ctx.extend(kw.clone());
    }
    ctx.extend(text.special.clone());
    let mut messages = match req.get("messages") {
        Some(Json::Array(m)) if !m.is_empty() => m.clone(),
        _ => return Err(invalid("messages must be a non-empty array".to_owned())),
    };
    for m in messages.iter_mut() {
        if !m.is_object() {
            return Err(invalid("each message must be an object".to_owned()));
        }
        flatten_content(m).map_err(invalid)?;
    }
    ctx.insert("messages".to_owned(), Json::Array(messages));
    let add_gen = req
        .get("add_generation_prompt")
        .and_then(Json::as_bool)
        .unwrap_or(true);
    ctx.insert("add_generation_prompt".to_owned(), Json::Bool(add_gen));
    for key in ["tools", "documents"] {
        if let Some(v) = req.get(key) {
            ctx.insert(key.to_owned(), v.clone());
        }
    }
    let tmpl = env
        .get_template("chat")
        .map_err(|e| (KVT_TEXT_INTERNAL, e.to_string()))?;
    tmpl.render(Serde(&Json::Object(ctx)))
        .map_err(|e| invalid(format!("the chat template refused the messages: {e}")))
}

fn guarded<T>(
    err: *mut *mut c_char,
    fallback: T,
    f: impl FnOnce() -> Result<T, (c_int, String)>,
    code: &mut c_int,
) -> T {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(v)) => {
            *code = 0;
            v
        }
        Ok(Err((c, msg))) => {
            *code = c;
            error_string(err, msg);
            fallback
        }
        Err(_) => {
            *code = KVT_TEXT_INTERNAL;
            error_string(err, "kvtier-text panicked".to_owned());
            fallback
        }
    }
}

unsafe fn bytes<'a>(p: *const c_char, len: usize) -> Result<&'a str, (c_int, String)> {
    if p.is_null() && len > 0 {
        return Err((KVT_TEXT_INVALID, "null text".to_owned()));
    }
    let b = if len == 0 {
        &[][..]
    } else {
        std::slice::from_raw_parts(p as *const u8, len)
    };
    std::str::from_utf8(b).map_err(|e| (KVT_TEXT_INVALID, format!("text is not UTF-8: {e}")))
}

/// Opens the model in `dir`; null with `*err` set (free it with
/// kvt_text_free_string) when it cannot.
#[no_mangle]
pub unsafe extern "C" fn kvt_text_open(dir: *const c_char, err: *mut *mut c_char) -> *mut KvtText {
    let mut code = 0;
    guarded(
        err,
        std::ptr::null_mut(),
        || {
            if dir.is_null() {
                return Err((KVT_TEXT_INVALID, "null model directory".to_owned()));
            }
            let d = CStr::from_ptr(dir).to_string_lossy().into_owned();
            open(Path::new(&d)).map(|t| Box::into_raw(Box::new(t)))
        },
        &mut code,
    )
}

/// Frees what kvt_text_open returned (null is fine).
#[no_mangle]
pub unsafe extern "C" fn kvt_text_close(text: *mut KvtText) {
    if !text.is_null() {
        drop(Box::from_raw(text));
    }
}

/// 1 when the model has a chat template.
#[no_mangle]
pub unsafe extern "C" fn kvt_text_has_chat_template(text: *const KvtText) -> c_int {
    (!text.is_null() && (*text).env.is_some()) as c_int
}

/// The vocabulary's size, added tokens included.
#[no_mangle]
pub unsafe extern "C" fn kvt_text_vocab_size(text: *const KvtText) -> usize {
    if text.is_null() {
        0
    } else {
        (*text).tokenizer.get_vocab_size(true)
    }
}

/// Token ids of `len` bytes of UTF-8 at `utf8` (with the model's special
/// tokens around them, as its post-processor adds them, when
/// `add_special_tokens`). 0 and `*ids`/`*n` set (free with
/// kvt_text_free_ids), or an error code and `*err`.
#[no_mangle]
pub unsafe extern "C" fn kvt_text_encode(
    text: *const KvtText,
    utf8: *const c_char,
    len: usize,
    add_special_tokens: c_int,
    ids: *mut *mut u32,
    n: *mut usize,
    err: *mut *mut c_char,
) -> c_int {
    let mut code = 0;
    guarded(
        err,
        (),
        || {
            if text.is_null() || ids.is_null() || n.is_null() {
                return Err((KVT_TEXT_INVALID, "null argument".to_owned()));
            }
            let s = bytes(utf8, len)?;
            let enc = (*text)
                .tokenizer
                .encode_fast(s, add_special_tokens != 0)
                .map_err(|e| (KVT_TEXT_INVALID, format!("cannot tokenize: {e}")))?;
            let boxed: Box<[u32]> = enc.get_ids().to_vec().into_boxed_slice();
            *n = boxed.len();
            *ids = Box::into_raw(boxed) as *mut u32;
            Ok(())
        },
        &mut code,
    );
    code
}

/// Renders a chat request (JSON: `messages`, optional
/// `add_generation_prompt` (default true), `tools`, `documents`,
/// `chat_template_kwargs`) through the model's template. 0 and `*out`
/// (NUL-terminated, `*out_len` bytes; free with kvt_text_free_string), or an
/// error code and `*err`.
#[no_mangle]
pub unsafe extern "C" fn kvt_text_render_chat(
    text: *const KvtText,
    request: *const c_char,
    len: usize,
    out: *mut *mut c_char,
    out_len: *mut usize,
    err: *mut *mut c_char,
) -> c_int {
    let mut code = 0;
    guarded(
        err,
        (),
        || {
            if text.is_null() || out.is_null() || out_len.is_null() {
                return Err((KVT_TEXT_INVALID, "null argument".to_owned()));
            }
            let rendered = render(&*text, bytes(request, len)?)?;
            if rendered.contains('\0') {
                return Err((
                    KVT_TEXT_INVALID,
                    "the rendered chat holds a NUL byte".to_owned(),
                ));
            }
            *out_len = rendered.len();
            *out = CString::new(rendered)
                .map_err(|e| (KVT_TEXT_INTERNAL, e.to_string()))?
                .into_raw();
            Ok(())
        },
        &mut code,
    );
    code
}

/// Frees ids kvt_text_encode returned.
#[no_mangle]
pub unsafe extern "C" fn kvt_text_free_ids(ids: *mut u32, n: usize) {
    if !ids.is_null() {
        drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(ids, n)));
    }
}

/// Frees a string this library returned.
#[no_mangle]
pub unsafe extern "C" fn kvt_text_free_string(s: *mut c_char) {
    if !s.is_null() {
        drop(CString::from_raw(s));
    }
}

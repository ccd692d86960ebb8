//! Tool calls that always parse: an llguidance grammar from the tool catalog and the call
//! format ([`grammar`]), run over a token trie of our own tokenizer's vocabulary, driving
//! `kv_core`'s constrained decoder through [`kv_core::decoder::TokenConstraint`].
//!
//! - [`Constrainer`]: built once per model (the trie over the vocabulary); hands out a
//!   [`Constraint`] per request for a catalog and a tool choice.
//! - [`Constraint`]: the mask for the next id ([`AllowedTokens`], the layout the graphs take),
//!   commits, the ids the grammar forces (llguidance's fast-forward tokens, tokenized as our
//!   tokenizer would write them), and whether it has ended.
//!
//! Token bytes as llguidance wants them: a normal token's text decoded (SentencePiece `▁` as a
//! space, `<0xNN>` byte-fallback pieces as their byte, GPT-2 byte-level BPE mapped back to
//! bytes), a control token as `0xFF` and its text (llguidance's special-token marker: grammar
//! text never matches it, `<name>` in a grammar does), unused ids as nothing (never allowed).

pub mod fixture;
pub mod grammar;

use std::sync::Arc;

use kv_core::allowed::AllowedTokens;
use kv_core::decoder::TokenConstraint;
use kv_core::{Error, Result};
use llguidance::api::TopLevelGrammar;
use llguidance::earley::SlicedBiasComputer;
use llguidance::{Matcher, ParserFactory};
use tokenizer::tools::{Tool, ToolChoice, ToolFormat};
use tokenizer::{TokenType, Tokenizer};
use toktrie::{InferenceCapabilities, TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};

pub use grammar::CallStyle;

/// The token FunctionGemma writes after its calls; a stop token where the vocabulary has it.
pub const FG_RESPONSE_START: &str = "<start_function_response>";

fn constraint_err(op: &'static str, reason: impl ToString) -> Error {
    Error::Constraint {
        op,
        reason: reason.to_string(),
    }
}

/// llguidance's view of our tokenizer: the trie of every id's bytes, and our own encoder for
/// the ids it forces, so forced runs are the ids the tokenizer would write.
struct Env {
    trie: TokTrie,
    tokenizer: Tokenizer,
    canonical: bool,
}

impl TokenizerEnv for Env {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        match std::str::from_utf8(s) {
            Ok(text) => self
                .tokenizer
                .encode_with(text, false, false)
                .into_iter()
                .map(|id| id as TokenId)
                .collect(),
            // Part of a character (llguidance splits at any byte): the trie's greedy cut.
            Err(_) => self.trie.greedy_tokenize(s),
        }
    }

    fn tokenize_is_canonical(&self) -> bool {
        self.canonical
    }
}

/// The bytes llguidance sees for `id` (see the crate doc).
pub fn token_word(tok: &Tokenizer, id: i32) -> Vec<u8> {
    match tok.token_type(id) {
        Some(TokenType::Control | TokenType::Unknown) => {
            let text = tok.token_text(id).unwrap_or_default();
            if text.is_empty() {
                return Vec::new();
            }
            let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
            w.extend_from_slice(text.as_bytes());
            w
        }
        Some(TokenType::UserDefined) => tok.token_text(id).unwrap_or_default().as_bytes().to_vec(),
        Some(TokenType::Normal | TokenType::Byte) => tok.token_bytes(id, false),
        _ => Vec::new(),
    }
}

/// How `tok` writes calls: its tool format, with FunctionGemma's markers as tokens where the
/// vocabulary has them as control tokens, and SmolLM2's list where its template writes one.
pub fn call_style(tok: &Tokenizer) -> Result<CallStyle> {
    let format = tok.tool_format().ok_or_else(|| {
        constraint_err(
            "call format",
            "the model's chat template has no tool syntax and its family no default",
        )
    })?;
    Ok(match format {
        ToolFormat::FunctionGemma => CallStyle::FunctionGemma {
            special_markers: tok
                .token_id(tokenizer::tools::FG_CALL_START)
                .and_then(|id| tok.token_type(id))
                == Some(TokenType::Control),
        },
        ToolFormat::Hermes => {
            let list = tok
                .chat_template()
                .and_then(|t| t.tool_template())
                .is_some_and(|t| t.text().contains("<tool_call>["));
            if list {
                CallStyle::HermesList
            } else {
                CallStyle::HermesObject
            }
        }
    })
}

/// A model's grammar engine: the trie over its vocabulary, built once (a 262,144-id vocabulary
/// takes a fraction of a second); [`Self::constraint`] per request.
pub struct Constrainer {
    factory: ParserFactory,
    vocab: usize,
    style: CallStyle,
}

impl Constrainer {
    /// For `tok`'s vocabulary and call format; stop tokens (EOS, end of turn, and FunctionGemma's
    /// `<start_function_response>` where it is a token) are the ids the grammar allows where it
    /// may end.
    pub fn new(tok: &Tokenizer) -> Result<Self> {
        Self::with_style(tok, call_style(tok)?)
    }

    pub fn with_style(tok: &Tokenizer, style: CallStyle) -> Result<Self> {
        let vocab = tok.vocab_size();
        let words: Vec<Vec<u8>> = (0..vocab as i32).map(|id| token_word(tok, id)).collect();
        let mut stops: Vec<i32> = tok.stop_tokens();
        // FunctionGemma ends its turn after a call with `<start_function_response>` (the app's
        // turn to answer): an end the grammar must allow where a call may end.
        if style == (CallStyle::FunctionGemma { special_markers: true }) {
            stops.extend(tok.token_id(FG_RESPONSE_START));
        }
        let stops: Vec<TokenId> = stops.into_iter().map(|id| id as TokenId).collect();
        let eos = *stops
            .first()
            .ok_or_else(|| constraint_err("vocabulary", "the tokenizer has no EOS or end-of-turn token"))?;
        let info = TokRxInfo {
            vocab_size: vocab as u32,
            tok_eos: eos,
            tok_bos: tok.bos().map(|b| b as TokenId),
            tok_pad: None,
            tok_unk: None,
            tok_end_of_turn: tok.eot().map(|e| e as TokenId),
        };
        let trie = TokTrie::from(&info, &words).with_eos_tokens(&stops);
        // Our encoder is what the model was trained on, unless it writes a leading space the
        // bytes do not hold (SentencePiece's `add_space_prefix`): then llguidance must not
        // force ids from it.
        let canonical = tok.decode(&tok.encode_with("a", false, false)) == "a";
        let env: TokEnv = Arc::new(Env {
            trie,
            tokenizer: tok.clone(),
            canonical,
        });
        let mut factory = ParserFactory::new(
            &env,
            InferenceCapabilities {
                ff_tokens: true,
                conditional_ff_tokens: false,
                backtrack: false,
                fork: false,
            },
            &SlicedBiasComputer::general_slices(),
        )
        .map_err(|e| constraint_err("vocabulary", e))?;
        factory.quiet();
        Ok(Constrainer { factory, vocab, style })
    }

    pub fn style(&self) -> CallStyle {
        self.style
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab
    }

    /// The constraint of a request with `tools` under `choice`; `None` for `none` (no grammar:
    /// the answer is text, and the template renders no tools).
    pub fn constraint(&self, tools: &[Tool], choice: &ToolChoice) -> Result<Option<Constraint>> {
        let Some(lark) = grammar::lark(self.style, tools, choice).map_err(|e| constraint_err("grammar", e))? else {
            return Ok(None);
        };
        self.from_lark(&lark).map(Some)
    }

    /// A constraint from any Lark grammar of llguidance's dialect.
    pub fn from_lark(&self, lark: &str) -> Result<Constraint> {
        let parser = self
            .factory
            .create_parser(TopLevelGrammar::from_lark(lark.to_string()))
            .map_err(|e| constraint_err("grammar", format!("{e}\n--- grammar ---\n{lark}")))?;
        Ok(Constraint {
            matcher: Matcher::new(Ok(parser)),
            vocab: self.vocab,
        })
    }
}

/// One request's grammar state.
pub struct Constraint {
    matcher: Matcher,
    vocab: usize,
}

impl Clone for Constraint {
    /// The same state, independent from here on (a catalog's constraint built once, cloned per
    /// request).
    fn clone(&self) -> Self {
        Constraint {
            matcher: self.matcher.deep_clone(),
            vocab: self.vocab,
        }
    }
}

impl Constraint {
    fn check(&self, op: &'static str) -> Result<()> {
        match self.matcher.get_error() {
            Some(e) => Err(constraint_err(op, e)),
            None => Ok(()),
        }
    }

    /// Whether the ids committed so far form a complete answer (a stop token may follow).
    pub fn is_accepting(&mut self) -> bool {
        self.matcher.is_accepting().unwrap_or(false)
    }
}

impl TokenConstraint for Constraint {
    fn allowed(&mut self) -> Result<AllowedTokens> {
        if self.matcher.is_stopped() {
            self.check("mask")?;
            return Ok(AllowedTokens::none(self.vocab));
        }
        let mask = self.matcher.compute_mask().map_err(|e| constraint_err("mask", e))?;
        let mut words = mask.as_slice().to_vec();
        words.resize(AllowedTokens::words_for(self.vocab), 0);
        AllowedTokens::from_words(self.vocab, words)
    }

    fn commit(&mut self, id: i32) -> Result<()> {
        let token = u32::try_from(id).map_err(|_| constraint_err("commit", format!("id {id} is negative")))?;
        self.matcher
            .consume_token(token)
            .map_err(|e| constraint_err("commit", format!("id {id}: {e}")))
    }

    fn forced(&mut self) -> Result<Vec<i32>> {
        if self.matcher.is_stopped() {
            return Ok(Vec::new());
        }
        let ids = self.matcher.compute_ff_tokens();
        self.check("forced tokens")?;
        Ok(ids.into_iter().map(|t| t as i32).collect())
    }

    fn is_done(&self) -> bool {
        self.matcher.is_stopped()
    }
}
